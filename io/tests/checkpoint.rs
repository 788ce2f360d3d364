//! Checkpoint storage: round trip, incremental reuse, crash at every step, corruption,
//! retention and GC, savepoints, and the documented metadata fixture.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use weir_io::{
    CheckpointError, CheckpointKind, CheckpointMetadata, CheckpointStorage, CommitInfo,
    CompletedCheckpoint, FaultConfig, FaultyFs, FileRef, FormatError, Fs, LogicalFileRef,
    Savepoint, SmallFileKind, StdFs, StorageOptions, VerifyError, DATA_HEADER_LEN, METADATA_FILE,
};

/// Small blocks and physical files, so multi-block files and rolling are exercised; uploads
/// are copied and framed (raw uploads have tests of their own below).
const OPTS: StorageOptions = StorageOptions {
    physical_file_bytes_max: 8_000,
    block_payload_bytes_max: 1_000,
    link_uploads: false,
    raw_diagnose: None,
};
const BLOCK_HEADER: u64 = 24;
/// [`OPTS`] with raw uploads, the default: hard links to the sources.
const RAW_OPTS: StorageOptions = StorageOptions {
    link_uploads: true,
    ..OPTS
};

fn bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// A local "segment" file to upload.
fn segment(dir: &Path, name: &str, len: usize, seed: u64) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let p = dir.join(name);
    std::fs::write(&p, bytes(len, seed)).unwrap();
    p
}

fn open(fs: Arc<dyn Fs>, root: &Path) -> CheckpointStorage {
    CheckpointStorage::open_with(fs, root, "job", OPTS).unwrap()
}

fn info(id: u64) -> CommitInfo {
    CommitInfo {
        trigger_timestamp_ms: 1000 * id,
        completion_timestamp_ms: 1000 * id + 7,
        sections: vec![("sources".into(), format!("offset={id}").into_bytes())],
    }
}

/// Data files on disk (relative to the job dir) with their sizes.
fn data_files(job: &Path) -> Vec<(PathBuf, u64)> {
    let mut out = Vec::new();
    for d in ["shared", "taskowned"] {
        for e in std::fs::read_dir(job.join(d)).unwrap() {
            let e = e.unwrap();
            out.push((
                Path::new(d).join(e.file_name()),
                e.metadata().unwrap().len(),
            ));
        }
    }
    out.sort();
    out
}

fn created_by(job: &Path, id: u64) -> Vec<(PathBuf, u64)> {
    data_files(job)
        .into_iter()
        .filter(|(p, _)| {
            p.file_name()
                .unwrap()
                .to_str()
                .unwrap()
                .starts_with(&format!("{id}-"))
        })
        .collect()
}

fn read_all_refs(st: &CheckpointStorage, m: &CheckpointMetadata) {
    for f in &m.files {
        assert_eq!(st.read_file(f).unwrap().len() as u64, f.size_bytes);
    }
    for l in &m.logical_files {
        assert_eq!(st.read_logical(l).unwrap().len() as u64, l.size_bytes);
    }
}

#[test]
fn round_trip_and_incremental_reuse() {
    let tmp = tempfile::tempdir().unwrap();
    let (root, local) = (tmp.path().join("ckpt"), tmp.path().join("local"));
    let st = open(Arc::new(StdFs), &root);
    let job = st.job_dir().to_owned();

    let s1 = segment(&local, "s1", 5_000, 1);
    let s2 = segment(&local, "s2", 3_000, 2);
    let p = st.begin(1).unwrap();
    let mut w = p.writer();
    let f1 = w.upload_shared(&s1, "seg-1").unwrap();
    let f2 = w.upload_shared(&s2, "seg-2").unwrap();
    let mut small: Vec<(LogicalFileRef, Vec<u8>)> = Vec::new();
    for i in 0..20u64 {
        let b = bytes((i as usize * 97) % 2_500, 100 + i);
        let kind = if i % 5 == 0 {
            SmallFileKind::Shared
        } else {
            SmallFileKind::TaskOwned
        };
        small.push((w.write_small(&b, kind).unwrap(), b));
    }
    w.finish().unwrap();
    let c1 = st.commit(p, info(1)).unwrap();

    // Listing, metadata, and every byte read back verified.
    let list = st.list().unwrap();
    assert_eq!(list.len(), 1);
    assert!(list[0].complete && list[0].id == 1);
    // On disk: the content and its framing, all of it written by this first checkpoint.
    assert_eq!(list[0].size_bytes, st.stored_bytes(&c1.metadata));
    assert_eq!(list[0].size_bytes, c1.metadata.new_bytes);
    assert!(list[0].size_bytes > c1.metadata.size_bytes());
    let m1 = st.read_metadata(1).unwrap();
    assert_eq!(m1, c1.metadata);
    assert_eq!(m1.section("sources"), Some(&b"offset=1"[..]));
    assert_eq!(st.read_file(&f1).unwrap(), std::fs::read(&s1).unwrap());
    assert_eq!(st.read_file(&f2).unwrap(), std::fs::read(&s2).unwrap());
    for (r, b) in &small {
        assert_eq!(&st.read_logical(r).unwrap(), b);
        let dir = if r.physical.starts_with("taskowned") {
            "taskowned"
        } else {
            "shared"
        };
        assert!(r.physical.starts_with(dir));
    }
    let physical: BTreeSet<_> = small.iter().map(|(r, _)| r.physical.clone()).collect();
    assert!(
        physical.len() >= 4,
        "merged files must roll at the limit: {physical:?}"
    );
    assert!(
        physical.len() < small.len(),
        "small files must be merged: {physical:?}"
    );
    let report = st.verify(1).unwrap();
    assert_eq!((report.files, report.logical_files), (2, 20));
    // new_bytes is exactly what landed on disk.
    let on_disk: u64 = data_files(&job).iter().map(|(_, n)| n).sum();
    assert_eq!(c1.metadata.new_bytes, on_disk);

    // Checkpoint 2, two writers on two threads: reuse both segments, upload one new one.
    let s3 = segment(&local, "s3", 1_500, 3);
    let p = st.begin(2).unwrap();
    let (mut wa, mut wb) = (p.writer(), p.writer());
    let (f3, l) = std::thread::scope(|s| {
        let a = s.spawn(|| {
            wa.reuse_shared(&f1).unwrap();
            wa.reuse_shared(&f2).unwrap();
            let f3 = wa.upload_shared(&s3, "seg-3").unwrap();
            wa.finish().unwrap();
            f3
        });
        let b = s.spawn(|| {
            let l = wb
                .write_small(b"in-flight", SmallFileKind::TaskOwned)
                .unwrap();
            wb.finish().unwrap();
            l
        });
        (a.join().unwrap(), b.join().unwrap())
    });
    let c2 = st.commit(p, info(2)).unwrap();
    let new2 = created_by(&job, 2);
    assert_eq!(new2.len(), 2, "only the new segment and one merged file");
    let expect_new = (DATA_HEADER_LEN as u64 + 1_500 + 2 * BLOCK_HEADER)
        + (DATA_HEADER_LEN as u64 + 9 + BLOCK_HEADER);
    assert_eq!(c2.metadata.new_bytes, expect_new);
    assert_eq!(new2.iter().map(|(_, n)| n).sum::<u64>(), expect_new);
    assert_eq!(created_by(&job, 1).len(), data_files(&job).len() - 2);
    let m2 = st.read_metadata(2).unwrap();
    assert_eq!(m2.files, {
        let mut v = vec![f1.clone(), f2.clone(), f3.clone()];
        v.sort();
        v
    });
    assert_eq!(m2.logical_files, vec![l.clone()]);
    assert_eq!(st.read_logical(&l).unwrap(), b"in-flight");
    st.verify(2).unwrap();
    assert_eq!(st.latest_complete().unwrap().unwrap().id, 2);
    assert!(matches!(
        st.begin(2),
        Err(CheckpointError::StaleId {
            checkpoint_id: 2,
            latest_complete: 2
        })
    ));
}

#[test]
fn commit_refuses_unfinished_or_failed_writers() {
    let tmp = tempfile::tempdir().unwrap();
    let st = open(Arc::new(StdFs), &tmp.path().join("c"));
    let p = st.begin(1).unwrap();
    let w = p.writer();
    let p2 = st.begin(2).unwrap();
    assert!(matches!(
        st.begin(2),
        Err(CheckpointError::AlreadyInProgress { .. })
    ));
    drop(w); // a writer dropped without finish fails its checkpoint
    assert!(matches!(
        st.commit(p, info(1)),
        Err(CheckpointError::Failed { .. })
    ));
    let w2 = p2.writer();
    let p2_commit = st.commit(p2, info(2));
    assert!(matches!(
        p2_commit,
        Err(CheckpointError::WritersNotFinished {
            open_writers: 1,
            ..
        })
    ));
    drop(w2);
    assert!(st.latest_complete().unwrap().is_none());
}

/// Write checkpoint `id`: reuse the shared files of `prev`, upload a new segment, write small
/// files of both kinds; commit.
fn write_checkpoint(
    st: &CheckpointStorage,
    id: u64,
    local: &Path,
    prev: Option<&CheckpointMetadata>,
) -> Result<CompletedCheckpoint, CheckpointError> {
    let seg = segment(local, &format!("seg{id}"), 2_100, id);
    let p = st.begin(id)?;
    let mut w = p.writer();
    if let Some(prev) = prev {
        for f in &prev.files {
            w.reuse_shared(f)?;
        }
    }
    w.upload_shared(&seg, "seg")?;
    for i in 0..3 {
        w.write_small(&bytes(1_500, id * 10 + i), SmallFileKind::TaskOwned)?;
    }
    w.write_small(b"small shared", SmallFileKind::Shared)?;
    w.finish()?;
    st.commit(p, info(id))
}

#[test]
fn crash_at_every_step_leaves_old_or_new_checkpoint() {
    crash_at_every_step(OPTS);
}

/// The same with raw uploads (hard links), and a failing link at every step too (the upload
/// then falls back to a framed copy).
#[test]
fn crash_at_every_step_leaves_old_or_new_checkpoint_with_raw_uploads() {
    crash_at_every_step(RAW_OPTS);
}

fn crash_at_every_step(opts: StorageOptions) {
    let open =
        |fs: Arc<dyn Fs>, root: &Path| CheckpointStorage::open_with(fs, root, "job", opts).unwrap();
    // Count the steps of checkpoint 2 without faults.
    let steps = {
        let tmp = tempfile::tempdir().unwrap();
        let (root, local) = (tmp.path().join("c"), tmp.path().join("l"));
        let c1 = write_checkpoint(&open(Arc::new(StdFs), &root), 1, &local, None).unwrap();
        let fs = FaultyFs::new(FaultConfig::default());
        write_checkpoint(
            &open(Arc::new(fs.clone()), &root),
            2,
            &local,
            Some(&c1.metadata),
        )
        .unwrap();
        fs.steps()
    };
    assert!(steps > 10, "{steps}");
    let mut outcomes = [0usize; 2];
    for step in 0..=steps {
        // Kinds 0-4 fail one operation and let the writer clean up; kind 5 cuts the power
        // there, so that whatever the attempt left stays for the next one to deal with.
        for kind in 0..6u64 {
            let seed = step * 6 + kind;
            let tmp = tempfile::tempdir().unwrap();
            let (root, local) = (tmp.path().join("c"), tmp.path().join("l"));
            let c1 = write_checkpoint(&open(Arc::new(StdFs), &root), 1, &local, None).unwrap();
            // step == steps: no fault, then a power cut after commit returned.
            let at = (step < steps).then_some(step);
            let fs = FaultyFs::new(FaultConfig {
                seed,
                tear_write_at_step: at.filter(|_| kind == 0),
                fail_sync_at_step: at.filter(|_| kind == 1),
                fail_rename_at_step: at.filter(|_| kind == 2),
                fail_link_at_step: at.filter(|_| kind == 3),
                fail_sync_dir_at_step: at.filter(|_| kind == 4),
                power_cut_at_step: at.filter(|_| kind == 5),
                ..FaultConfig::default()
            });
            // Opening the storage takes steps too (it makes its directories durable).
            let r = CheckpointStorage::open_with(Arc::new(fs.clone()), &root, "job", opts)
                .and_then(|st| write_checkpoint(&st, 2, &local, Some(&c1.metadata)));
            fs.crash().unwrap();

            let st = open(Arc::new(StdFs), &root);
            let msg = format!("seed {seed} (step {step}, kind {kind}), commit {r:?}");
            st.verify(1)
                .unwrap_or_else(|e| panic!("{msg}: old checkpoint broken: {e}"));
            read_all_refs(&st, &st.read_metadata(1).unwrap());
            let latest = st.latest_complete().unwrap().unwrap().id;
            if r.is_ok() {
                assert_eq!(latest, 2, "{msg}: a committed checkpoint was lost");
                st.verify(2).unwrap_or_else(|e| panic!("{msg}: {e}"));
                outcomes[1] += 1;
            } else {
                assert_eq!(latest, 1, "{msg}: a failed checkpoint is complete");
                assert!(
                    st.list().unwrap().iter().all(|i| i.id != 2 || !i.complete),
                    "{msg}"
                );
                outcomes[0] += 1;
            }
            // The next checkpoint and GC remove every orphan the failed attempt left.
            let base = st.read_metadata(latest).unwrap();
            let c3 = write_checkpoint(&st, 3, &local, Some(&base)).unwrap();
            st.retain(1).unwrap();
            let referenced = c3.metadata.physical_paths();
            let on_disk: BTreeSet<PathBuf> = data_files(st.job_dir())
                .into_iter()
                .map(|(p, _)| p)
                .collect();
            assert_eq!(on_disk, referenced, "{msg}: orphans left behind");
            st.verify(3).unwrap_or_else(|e| panic!("{msg}: {e}"));
        }
    }
    assert!(outcomes[0] > 0 && outcomes[1] > 0, "{outcomes:?}");
}

/// Retention interrupted at each of its steps, by a failing directory fsync or by a power
/// cut, then a crash: every checkpoint still listed complete is whole (its metadata never
/// outlives a file it references), the newest survives, a `retain` that returned kept all its
/// removals, and the next `retain` leaves exactly the newest checkpoint's files.
#[test]
fn crash_at_every_step_of_retain_keeps_every_complete_checkpoint_whole() {
    // Checkpoints 1-4 in a chain, an attempt 5 cut off mid-way (its directory and files stay),
    // and 6 after it: `retain(1)` drops four checkpoints, removes the incomplete one and
    // deletes what only those referenced.
    let setup = |root: &Path, local: &Path, cut_at: Option<u64>| {
        let st = open(Arc::new(StdFs), root);
        let mut prev: Option<CheckpointMetadata> = None;
        for id in 1..=4 {
            prev = Some(
                write_checkpoint(&st, id, local, prev.as_ref())
                    .unwrap()
                    .metadata,
            );
        }
        drop(st);
        let fs = FaultyFs::new(FaultConfig {
            power_cut_at_step: cut_at,
            ..FaultConfig::default()
        });
        let cut = write_checkpoint(&open(Arc::new(fs.clone()), root), 5, local, prev.as_ref());
        if cut.is_ok() {
            // No cut, or one past the metadata (only the best-effort marker failed).
            return Err(fs.steps());
        }
        assert!(fs.power_is_cut(), "{cut:?}");
        fs.crash().unwrap();
        let c6 = write_checkpoint(&open(Arc::new(StdFs), root), 6, local, prev.as_ref());
        Ok(c6.unwrap())
    };
    // The power goes at the last step of attempt 5 that fails it (its metadata's directory
    // fsync): everything else it wrote stays.
    let tmp = tempfile::tempdir().unwrap();
    let all_steps = setup(&tmp.path().join("c"), &tmp.path().join("l"), None).unwrap_err();
    let cut_5 = (0..all_steps)
        .rev()
        .find(|&c| {
            let tmp = tempfile::tempdir().unwrap();
            setup(&tmp.path().join("c"), &tmp.path().join("l"), Some(c)).is_ok()
        })
        .expect("a cut that fails attempt 5");
    let steps = {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("c");
        setup(&root, &tmp.path().join("l"), Some(cut_5)).unwrap();
        let st = open(Arc::new(StdFs), &root);
        assert!(st.list().unwrap().iter().any(|i| i.id == 5 && !i.complete));
        drop(st);
        let fs = FaultyFs::new(FaultConfig::default());
        let st = open(Arc::new(fs.clone()), &root);
        let before = fs.steps();
        let report = st.retain(1).unwrap();
        assert_eq!(report.dropped_checkpoints, [1, 2, 3, 4]);
        assert_eq!(report.removed_incomplete, [5]);
        assert!(!report.deleted_files.is_empty());
        fs.steps() - before
    };
    assert!(steps > 10, "{steps}");
    // (an older checkpoint still complete, only the newest) after the crash.
    let mut outcomes = [0usize; 2];
    for step in 0..=steps {
        for kind in 0..2u64 {
            let tmp = tempfile::tempdir().unwrap();
            let root = tmp.path().join("c");
            let c6 = setup(&root, &tmp.path().join("l"), Some(cut_5)).unwrap();
            let fs = FaultyFs::new(FaultConfig::default());
            let st = open(Arc::new(fs.clone()), &root);
            // The steps opening took, so that the fault lands within `retain`.
            let at = (step < steps).then_some(fs.steps() + step);
            let fs = FaultyFs::new(FaultConfig {
                seed: step * 2 + kind,
                fail_sync_dir_at_step: at.filter(|_| kind == 0),
                power_cut_at_step: at.filter(|_| kind == 1),
                ..FaultConfig::default()
            });
            drop(st);
            let r = open(Arc::new(fs.clone()), &root).retain(1);
            fs.crash().unwrap();

            let msg = format!("step {step}, kind {kind}: retain {r:?}");
            let st = open(Arc::new(StdFs), &root);
            let list = st.list().unwrap();
            for i in list.iter().filter(|i| i.complete) {
                st.verify(i.id)
                    .unwrap_or_else(|e| panic!("{msg}: checkpoint {} broken: {e}", i.id));
                read_all_refs(&st, &st.read_metadata(i.id).unwrap());
            }
            assert_eq!(st.latest_complete().unwrap().unwrap().id, 6, "{msg}");
            let complete = list.iter().filter(|i| i.complete).count();
            if r.is_ok() {
                assert_eq!(
                    list.len(),
                    1,
                    "{msg}: a removal of a finished retain was lost"
                );
            }
            outcomes[usize::from(complete == 1)] += 1;
            st.retain(1)
                .unwrap_or_else(|e| panic!("{msg}: the next retain: {e}"));
            let ids: Vec<(u64, bool)> = st
                .list()
                .unwrap()
                .iter()
                .map(|i| (i.id, i.complete))
                .collect();
            assert_eq!(ids, [(6, true)], "{msg}");
            let on_disk: BTreeSet<PathBuf> = data_files(st.job_dir())
                .into_iter()
                .map(|(p, _)| p)
                .collect();
            assert_eq!(
                on_disk,
                c6.metadata.physical_paths(),
                "{msg}: orphans left behind"
            );
            st.verify(6).unwrap_or_else(|e| panic!("{msg}: {e}"));
        }
    }
    assert!(outcomes[0] > 0 && outcomes[1] > 0, "{outcomes:?}");
}

fn expect_corrupt(r: Result<weir_io::VerifyReport, VerifyError>) -> FormatError {
    match r {
        Err(VerifyError::Corrupt { source, .. }) => source,
        other => panic!("expected corruption, got {other:?}"),
    }
}

fn expect_format<T: std::fmt::Debug>(r: Result<T, CheckpointError>) -> FormatError {
    match r {
        Err(CheckpointError::Format(e)) => e,
        other => panic!("expected a format error, got {other:?}"),
    }
}

/// Bytes appended to a file a checkpoint wrote are covered by no CRC, so `verify` refuses
/// them: past a framed upload's last block, past the last logical file of a merged file the
/// checkpoint created (shared or task-owned). Both passed, and savepoints copied them.
#[test]
fn bytes_past_the_last_block_or_logical_file_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let (root, local) = (tmp.path().join("c"), tmp.path().join("l"));
    let st = open(Arc::new(StdFs), &root);
    let job = st.job_dir().to_owned();
    let c1 = write_checkpoint(&st, 1, &local, None).unwrap();
    write_checkpoint(&st, 2, &local, Some(&c1.metadata)).unwrap();
    let of_2 = |dir: &str, hint: &str| -> PathBuf {
        std::fs::read_dir(job.join(dir))
            .unwrap()
            .flatten()
            .map(|e| e.path())
            .find(|p| {
                let n = p.file_name().unwrap().to_str().unwrap();
                n.starts_with("2-") && n.ends_with(hint)
            })
            .unwrap_or_else(|| panic!("a {hint} file of checkpoint 2 in {dir}"))
    };
    for path in [
        of_2("shared", "seg"),
        of_2("shared", "merged"),
        of_2("taskowned", "merged"),
    ] {
        let good = std::fs::read(&path).unwrap();
        let mut bad = good.clone();
        bad.extend_from_slice(b"garbage!");
        std::fs::write(&path, &bad).unwrap();
        let e = expect_corrupt(st.verify(2));
        assert_eq!(
            (e.file(), e.offset()),
            (path.as_path(), good.len() as u64),
            "{e}"
        );
        assert!(e.to_string().contains("8 bytes past the end"), "{e}");
        // Checkpoint 1 reuses none of it.
        st.verify(1).unwrap();
        std::fs::write(&path, &good).unwrap();
        st.verify(2).unwrap();
    }
}

/// A `_metadata` that is a directory damages its checkpoint, not the job's listing: it
/// failed `list` (and with it every `weir checkpoints` command and `--restore latest`) with
/// "Is a directory", and the intact checkpoints beside it were neither listed nor verified.
#[test]
fn a_metadata_directory_is_a_damaged_checkpoint_beside_intact_ones() {
    let tmp = tempfile::tempdir().unwrap();
    let (root, local) = (tmp.path().join("c"), tmp.path().join("l"));
    let st = open(Arc::new(StdFs), &root);
    let job = st.job_dir().to_owned();
    write_checkpoint(&st, 1, &local, None).unwrap();
    write_checkpoint(&st, 2, &local, None).unwrap();
    let meta_path = job.join("chk-1").join(METADATA_FILE);
    std::fs::remove_file(&meta_path).unwrap();
    std::fs::create_dir(&meta_path).unwrap();
    let listed = st.list().unwrap();
    let state: Vec<_> = listed
        .iter()
        .map(|i| (i.id, i.complete, i.metadata_corrupt))
        .collect();
    assert_eq!(state, [(1, false, true), (2, true, false)]);
    let problem = listed[0].problem.as_deref().unwrap();
    assert!(problem.contains("a directory"), "{problem}");
    let e = expect_format(st.read_metadata(1));
    assert_eq!((e.file(), e.offset()), (meta_path.as_path(), 0));
    assert_eq!(st.latest_complete().unwrap().map(|i| i.id), Some(2));
    st.verify(2).unwrap();
    assert_eq!(expect_corrupt(st.verify(1)).file(), meta_path);
}

#[test]
fn corruption_names_file_and_offset() {
    let tmp = tempfile::tempdir().unwrap();
    let (root, local) = (tmp.path().join("c"), tmp.path().join("l"));
    let st = open(Arc::new(StdFs), &root);
    let job = st.job_dir().to_owned();
    let c1 = write_checkpoint(&st, 1, &local, None).unwrap();
    let m = c1.metadata;
    let meta_path = job.join("chk-1").join(METADATA_FILE);
    let good_meta = std::fs::read(&meta_path).unwrap();

    // A flipped byte in the metadata: caught by its CRC, named at the CRC's offset.
    FaultyFs::flip_bit(&meta_path, 30, 2).unwrap();
    let e = expect_corrupt(st.verify(1));
    assert_eq!(e.file(), meta_path);
    assert!(
        matches!(e, FormatError::ChecksumMismatch { offset, .. } if offset == good_meta.len() as u64 - 4)
    );
    let listed = &st.list().unwrap()[0];
    assert!(!listed.complete && listed.metadata_corrupt, "{listed:?}");
    // The job directory's record of the newest completed checkpoint outlives its metadata;
    // a record that fails its CRC says nothing.
    let marker = job.join(weir_io::COMPLETED_FILE);
    assert_eq!(
        std::fs::read_to_string(&marker).unwrap(),
        format!("1 {:08x}\n", crc32fast::hash(b"1"))
    );
    assert_eq!(st.completed_marker(), Some(1));
    let good_marker = std::fs::read(&marker).unwrap();
    std::fs::write(&marker, b"7 00000000\n").unwrap();
    assert_eq!(st.completed_marker(), None);
    // `completed_record` tells such a record, naming the file and where, from a missing one.
    let damaged = |st: &CheckpointStorage| match st.completed_record() {
        Err(weir_io::CheckpointError::Format(f)) => {
            assert_eq!(f.file(), marker);
            f
        }
        other => panic!("{other:?}"),
    };
    assert!(matches!(
        damaged(&st),
        FormatError::ChecksumMismatch {
            offset: 2,
            expected: 0,
            ..
        }
    ));
    for bad in [
        &b""[..],
        b"1",
        b"1 \n",
        b"1\n",
        b"\xff 1\n",
        b"1 0000000g\n",
    ] {
        std::fs::write(&marker, bad).unwrap();
        damaged(&st);
        assert_eq!(st.completed_marker(), None);
    }
    std::fs::write(&marker, &good_marker).unwrap();
    assert_eq!(st.completed_record().unwrap(), Some(1));
    assert!(st.latest_complete().unwrap().is_none());
    // A missing metadata file is a checkpoint cut short, not corruption.
    std::fs::remove_file(&meta_path).unwrap();
    let listed = &st.list().unwrap()[0];
    assert!(!listed.complete && !listed.metadata_corrupt, "{listed:?}");
    std::fs::write(&meta_path, &good_meta).unwrap();
    st.verify(1).unwrap();
    assert!(st.list().unwrap()[0].complete && !st.list().unwrap()[0].metadata_corrupt);

    // A flipped byte in the second block of an uploaded file.
    let f: &FileRef = &m.files[0];
    let fpath = job.join(&f.path);
    let block1 = DATA_HEADER_LEN as u64 + BLOCK_HEADER + 1_000;
    FaultyFs::flip_bit(&fpath, block1 + BLOCK_HEADER + 5, 0).unwrap();
    let e = expect_format(st.read_file(f));
    assert!(
        matches!(&e, FormatError::ChecksumMismatch { file, offset, .. } if *file == fpath && *offset == block1),
        "{e}"
    );
    let e = expect_corrupt(st.verify(1));
    assert_eq!((e.file(), e.offset()), (fpath.as_path(), block1));
    FaultyFs::flip_bit(&fpath, block1 + BLOCK_HEADER + 5, 0).unwrap();

    // A flipped byte in one logical file of a merged physical file: that one fails, its
    // neighbour in the same physical file still reads.
    let (l1, l2) = m
        .logical_files
        .iter()
        .zip(m.logical_files.iter().skip(1))
        .find(|(a, b)| a.physical == b.physical)
        .expect("two logical files share a physical file");
    let ppath = job.join(&l2.physical);
    FaultyFs::flip_bit(&ppath, l2.offset + BLOCK_HEADER + 3, 7).unwrap();
    let e = expect_format(st.read_logical(l2));
    assert_eq!((e.file(), e.offset()), (ppath.as_path(), l2.offset));
    st.read_logical(l1).unwrap();
    let e = expect_corrupt(st.verify(1));
    assert_eq!((e.file(), e.offset()), (ppath.as_path(), l2.offset));
    FaultyFs::flip_bit(&ppath, l2.offset + BLOCK_HEADER + 3, 7).unwrap();
    st.verify(1).unwrap();

    // Truncated metadata and data file.
    std::fs::write(&meta_path, &good_meta[..good_meta.len() - 9]).unwrap();
    assert!(matches!(
        expect_corrupt(st.verify(1)),
        FormatError::Truncated { .. }
    ));
    std::fs::write(&meta_path, &good_meta).unwrap();
    let good_file = std::fs::read(&fpath).unwrap();
    std::fs::write(&fpath, &good_file[..good_file.len() / 2]).unwrap();
    let e = expect_format(st.read_file(f));
    assert!(
        matches!(&e, FormatError::Truncated { file, .. } if *file == fpath),
        "{e}"
    );

    // Foreign files.
    std::fs::write(&fpath, b"#!/bin/sh\necho not a checkpoint file at all\n").unwrap();
    let e = expect_format(st.read_file(f));
    assert!(
        matches!(&e, FormatError::BadMagic { file, offset: 0, .. } if *file == fpath),
        "{e}"
    );
    std::fs::write(&meta_path, b"{\"json\": true}").unwrap();
    assert!(matches!(
        expect_format(st.read_metadata(1)),
        FormatError::BadMagic { .. }
    ));
    // A future version is refused by version, not by checksum.
    let mut v3 = good_meta.clone();
    v3[8] = weir_io::METADATA_VERSION as u8 + 1;
    std::fs::write(&meta_path, &v3).unwrap();
    assert!(matches!(
        expect_format(st.read_metadata(1)),
        FormatError::UnsupportedVersion { found, .. } if found == weir_io::METADATA_VERSION + 1
    ));
    std::fs::write(&meta_path, &good_meta).unwrap();

    // A valid data file in the wrong place (misdirected): caught by its header.
    let other = job.join(&m.logical_files[0].physical);
    std::fs::write(&fpath, std::fs::read(&other).unwrap()).unwrap();
    let e = expect_format(st.read_file(f));
    assert!(
        matches!(&e, FormatError::Misdirected { file, .. } if *file == fpath),
        "{e}"
    );
    std::fs::write(&fpath, &good_file).unwrap();
    st.verify(1).unwrap();

    // Every single-byte truncation of the metadata is a typed error, never a panic.
    for cut in 0..good_meta.len() {
        CheckpointMetadata::decode(&meta_path, &good_meta[..cut]).unwrap_err();
    }
}

/// Sets the length of the file at `path` (sparse past its end: no disk, as `truncate -s`).
fn set_len(path: &Path, len: u64) {
    std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .unwrap()
        .set_len(len)
        .unwrap();
}

/// An oversized `_metadata` (`truncate -s 1T`) is corruption named by its file and size, found
/// from its length and header without reading it: reading it whole aborted every command
/// ("memory allocation of 1099511627776 bytes failed"). Its checkpoint lists as one whose
/// metadata is corrupt, as any corrupt metadata does, and the others as before.
#[test]
fn oversized_metadata_is_a_typed_error_not_an_allocation() {
    const TIB: u64 = 1 << 40;
    // Header, a body of u32::MAX bytes, CRC: the longest a metadata file can be.
    const LEN_MAX: u64 = 16 + u32::MAX as u64 + 4;
    let tmp = tempfile::tempdir().unwrap();
    let (root, local) = (tmp.path().join("c"), tmp.path().join("l"));
    let fs: Arc<dyn Fs> = Arc::new(StdFs);
    let st = open(fs.clone(), &root);
    let job = st.job_dir().to_owned();
    let c1 = write_checkpoint(&st, 1, &local, None).unwrap();
    let c2 = write_checkpoint(&st, 2, &local, Some(&c1.metadata)).unwrap();
    write_checkpoint(&st, 3, &local, Some(&c2.metadata)).unwrap();
    let meta2 = job.join("chk-2").join(METADATA_FILE);
    let good_len = std::fs::metadata(&meta2).unwrap().len();

    // The repro: the valid metadata, then zeros up to 1 TiB.
    set_len(&meta2, TIB);
    let too_long = |e: &FormatError| {
        matches!(e, FormatError::Malformed { file, offset, reason }
            if *file == meta2 && *offset == LEN_MAX && reason.contains(&TIB.to_string()))
    };
    let e = expect_format(st.read_metadata(2));
    assert!(too_long(&e), "{e}");
    assert!(too_long(&expect_corrupt(st.verify(2))));
    let check_listing = |st: &CheckpointStorage| {
        let listed = st.list().unwrap();
        let seen: Vec<_> = listed
            .iter()
            .map(|i| (i.id, i.complete, i.metadata_corrupt))
            .collect();
        assert_eq!(
            seen,
            vec![(1, true, false), (2, false, true), (3, true, false)]
        );
        let problem = listed[1].problem.as_deref().unwrap();
        assert!(
            problem.contains(&meta2.display().to_string()) && problem.contains(&TIB.to_string()),
            "{problem}"
        );
        assert_eq!(st.latest_complete().unwrap().unwrap().id, 3);
    };
    check_listing(&st);
    // Opening a storage lists it (what `weir checkpoints list` does first).
    check_listing(&CheckpointStorage::open_read_only(fs.clone(), &root, "job").unwrap());
    st.verify(1).unwrap();
    st.verify(3).unwrap();

    // A sparse file of zeros alone: refused by its length before its (missing) magic.
    std::fs::remove_file(&meta2).unwrap();
    std::fs::File::create(&meta2).unwrap();
    set_len(&meta2, TIB);
    let e = expect_format(st.read_metadata(2));
    assert!(too_long(&e), "{e}");
    check_listing(&st);

    // The valid metadata followed by zeros, shorter than the longest a metadata file can be
    // but longer than its header says: refused by its header, still without reading it.
    std::fs::write(&meta2, c2.metadata.encode()).unwrap();
    st.read_metadata(2).unwrap();
    let two_gib = 2u64 << 30;
    set_len(&meta2, two_gib);
    let e = expect_format(st.read_metadata(2));
    assert!(
        matches!(&e, FormatError::Malformed { file, offset, reason }
            if *file == meta2 && *offset == good_len && reason.contains(&two_gib.to_string())),
        "{e}"
    );
    set_len(&meta2, TIB);

    // Retention leaves a corrupt metadata in place for inspection, as ever, and works on.
    let r = st.retain(1).unwrap();
    assert_eq!(r.dropped_checkpoints, vec![1]);
    assert_eq!(std::fs::metadata(&meta2).unwrap().len(), TIB);
    let ids: Vec<u64> = st.list().unwrap().iter().map(|i| i.id).collect();
    assert_eq!(ids, vec![2, 3]);
    st.verify(3).unwrap();

    // A savepoint's metadata is read the same way.
    let sp = st
        .export_savepoint(3, &tmp.path().join("sp"), "sp")
        .unwrap();
    Savepoint::open(fs.clone(), &sp).unwrap();
    let sp_meta = sp.join(METADATA_FILE);
    set_len(&sp_meta, TIB);
    let e = expect_format(Savepoint::open(fs, &sp));
    assert!(
        matches!(&e, FormatError::Malformed { file, offset, .. } if *file == sp_meta && *offset == LEN_MAX),
        "{e}"
    );
}

/// A directory without `_metadata` (an export that crashed before publishing it, or not a
/// savepoint at all) is refused naming the directory. It was "checkpoint 0 not found": a
/// savepoint has no id, and there was no checkpoint 0.
#[test]
fn a_directory_without_metadata_is_no_savepoint() {
    let tmp = tempfile::tempdir().unwrap();
    let e = Savepoint::open(Arc::new(StdFs), tmp.path()).unwrap_err();
    assert!(
        matches!(&e, CheckpointError::NoSavepoint { dir, .. } if dir == tmp.path()),
        "{e:?}"
    );
    assert_eq!(
        e.to_string(),
        format!(
            "{} is not a savepoint or checkpoint directory: it holds no _metadata",
            tmp.path().display()
        )
    );
}

#[test]
fn bit_flip_while_writing_is_caught_by_verify() {
    // Steps 0..: header write of the upload, its block writes, ... flip a bit in each write.
    for step in 0..6u64 {
        let tmp = tempfile::tempdir().unwrap();
        let (root, local) = (tmp.path().join("c"), tmp.path().join("l"));
        // The steps of opening a new storage (its directory syncs), counted on another root.
        let open_steps = {
            let probe = FaultyFs::new(FaultConfig::default());
            open(Arc::new(probe.clone()), &tmp.path().join("probe"));
            probe.steps()
        };
        let fs = FaultyFs::new(FaultConfig {
            seed: step,
            flip_bit_at_step: Some(open_steps + step),
            ..FaultConfig::default()
        });
        let st = open(Arc::new(fs.clone()), &root);
        write_checkpoint(&st, 1, &local, None).unwrap();
        let e = expect_corrupt(st.verify(1));
        assert!(
            e.file().starts_with(st.job_dir()),
            "seed {}: {e}",
            fs.seed()
        );
    }
}

#[test]
fn retention_keeps_referenced_and_deletes_the_rest() {
    let tmp = tempfile::tempdir().unwrap();
    let (root, local) = (tmp.path().join("c"), tmp.path().join("l"));
    let st = open(Arc::new(StdFs), &root);
    let job = st.job_dir().to_owned();
    let c1 = write_checkpoint(&st, 1, &local, None).unwrap();
    let c2 = write_checkpoint(&st, 2, &local, Some(&c1.metadata)).unwrap();

    // Checkpoint 3 is abandoned (the process "crashed" mid-way): its files are orphans.
    {
        let p = st.begin(3).unwrap();
        let mut w = p.writer();
        w.upload_shared(&segment(&local, "x", 100, 9), "x").unwrap();
        w.write_small(b"lost", SmallFileKind::TaskOwned).unwrap();
        w.finish().unwrap();
    }
    let orphans3 = created_by(&job, 3);
    assert_eq!(orphans3.len(), 2);
    let c4 = write_checkpoint(&st, 4, &local, Some(&c2.metadata)).unwrap();

    // Checkpoint 6 is aborted: its files go at once.
    let p6 = st.begin(6).unwrap();
    let mut w = p6.writer();
    w.write_small(b"aborted", SmallFileKind::TaskOwned).unwrap();
    assert_eq!(created_by(&job, 6).len(), 1);
    drop(w);
    st.abort(p6).unwrap();
    assert!(created_by(&job, 6).is_empty());

    // Checkpoint 5 is in progress during GC: its files (new and reused) must survive.
    let p5 = st.begin(5).unwrap();
    let mut w5 = p5.writer();
    for f in &c4.metadata.files {
        w5.reuse_shared(f).unwrap();
    }
    let l5 = w5
        .write_small(b"in progress", SmallFileKind::TaskOwned)
        .unwrap();
    let in_progress5 = created_by(&job, 5);

    let r = st.retain(2).unwrap();
    assert_eq!(r.dropped_checkpoints, vec![1]);
    assert!(!job.join("chk-1").exists());
    let on_disk: BTreeSet<PathBuf> = data_files(&job).into_iter().map(|(p, _)| p).collect();
    let mut expect: BTreeSet<PathBuf> = c2.metadata.physical_paths();
    expect.extend(c4.metadata.physical_paths());
    expect.extend(in_progress5.iter().map(|(p, _)| p.clone()));
    assert_eq!(on_disk, expect);
    for (p, _) in &orphans3 {
        assert!(r.deleted_files.contains(p), "orphan {p:?} kept");
    }
    let only1: Vec<_> = c1
        .metadata
        .physical_paths()
        .into_iter()
        .filter(|p| !expect.contains(p))
        .collect();
    assert!(!only1.is_empty());
    for p in &only1 {
        assert!(
            r.deleted_files.contains(p),
            "{p:?} of dropped checkpoint 1 kept"
        );
    }
    st.verify(2).unwrap();
    st.verify(4).unwrap();
    read_all_refs(&st, &c2.metadata);

    let r = st.retain(1).unwrap();
    assert_eq!(r.dropped_checkpoints, vec![2]);
    let on_disk: BTreeSet<PathBuf> = data_files(&job).into_iter().map(|(p, _)| p).collect();
    let mut expect = c4.metadata.physical_paths();
    expect.extend(in_progress5.iter().map(|(p, _)| p.clone()));
    assert_eq!(on_disk, expect);
    st.verify(4).unwrap();
    assert_eq!(
        st.list().unwrap().iter().map(|i| i.id).collect::<Vec<_>>(),
        vec![4]
    );

    // Checkpoint 5 completes; then 4's own files go, the reused ones stay.
    w5.finish().unwrap();
    let c5 = st.commit(p5, info(5)).unwrap();
    assert_eq!(st.read_logical(&l5).unwrap(), b"in progress");
    st.retain(1).unwrap();
    let on_disk: BTreeSet<PathBuf> = data_files(&job).into_iter().map(|(p, _)| p).collect();
    assert_eq!(on_disk, c5.metadata.physical_paths());
    st.verify(5).unwrap();
    assert!(st.retain(0).is_err());
}

/// Only `chk-<n>` spelt as storage writes it is a checkpoint's directory: `chk-04` or `chk-+4`
/// beside `chk-4` was listed as a second checkpoint 4 and `retain` deleted its contents as 4's
/// ("kept [4], dropped [4]"). Another spelling is not storage's: never listed, never deleted,
/// and neither is a data file whose name spells its ids otherwise.
#[test]
fn other_spellings_of_an_id_are_not_checkpoints_and_survive_retention() {
    let tmp = tempfile::tempdir().unwrap();
    let (root, local) = (tmp.path().join("c"), tmp.path().join("l"));
    let st = open(Arc::new(StdFs), &root);
    let job = st.job_dir().to_owned();
    let c3 = write_checkpoint(&st, 3, &local, None).unwrap();
    let c4 = write_checkpoint(&st, 4, &local, Some(&c3.metadata)).unwrap();
    // Copies of 4's and 3's directories under other names (the metadata inside verifies),
    // and an empty one, which a canonical name would make an incomplete checkpoint.
    let foreign: Vec<PathBuf> = ["chk-04", "chk-+4", "chk-004", "chk-03", "chk-+3", "chk-01"]
        .iter()
        .map(|n| job.join(n))
        .collect();
    for dir in &foreign {
        std::fs::create_dir(dir).unwrap();
        let name = dir.file_name().unwrap().to_str().unwrap();
        if let Some(of) = ["4", "3"].into_iter().find(|id| name.ends_with(id)) {
            std::fs::copy(
                job.join(format!("chk-{of}")).join(METADATA_FILE),
                dir.join(METADATA_FILE),
            )
            .unwrap();
        }
        std::fs::write(dir.join("notes"), name).unwrap();
    }
    // A canonical incomplete directory older than the newest checkpoint: removed, as ever.
    std::fs::create_dir(job.join("chk-2")).unwrap();
    // Data files spelling a checkpoint's or file's id otherwise: never GC's to delete.
    let stray: Vec<PathBuf> = [
        "shared/03-0000000000000001-seg",
        "shared/+3-0000000000000002-seg",
        "shared/3-00000000000000AB-seg",
        "taskowned/03-0000000000000003-merged",
    ]
    .iter()
    .map(|r| job.join(r))
    .collect();
    for p in &stray {
        std::fs::write(p, b"not storage's").unwrap();
    }

    let listed = st.list().unwrap();
    let ids: Vec<(u64, bool)> = listed.iter().map(|i| (i.id, i.complete)).collect();
    assert_eq!(ids, vec![(2, false), (3, true), (4, true)]);
    assert_eq!(listed[2].path, job.join("chk-4"));
    assert_eq!(st.latest_complete().unwrap().unwrap().id, 4);

    let r = st.retain(1).unwrap();
    assert_eq!(r.dropped_checkpoints, vec![3]);
    assert_eq!(r.removed_incomplete, vec![2]);
    assert!(!job.join("chk-3").exists() && !job.join("chk-2").exists());
    for dir in &foreign {
        let name = dir.file_name().unwrap().to_str().unwrap();
        assert_eq!(
            std::fs::read_to_string(dir.join("notes")).unwrap(),
            name,
            "{name} kept whole"
        );
    }
    assert!(job.join("chk-04").join(METADATA_FILE).exists());
    assert!(job.join("chk-03").join(METADATA_FILE).exists());
    for p in &stray {
        assert!(p.exists(), "{} kept", p.display());
        assert!(
            !r.deleted_files.iter().any(|d| job.join(d) == *p),
            "{} reported deleted",
            p.display()
        );
    }
    // The canonical checkpoint is whole, and listed once.
    st.verify(4).unwrap();
    read_all_refs(&st, &c4.metadata);
    let ids: Vec<u64> = st.list().unwrap().iter().map(|i| i.id).collect();
    assert_eq!(ids, vec![4]);
    assert_eq!(st.retain(1).unwrap(), weir_io::GcReport::default());

    // Tools that take a directory name parse it the same way.
    assert_eq!(weir_io::parse_checkpoint_dir_name("chk-4"), Some(4));
    assert_eq!(weir_io::parse_checkpoint_dir_name("chk-0"), Some(0));
    for bad in ["chk-04", "chk-+4", "chk-004", "chk-", "chk-4x"] {
        assert_eq!(weir_io::parse_checkpoint_dir_name(bad), None, "{bad}");
    }

    // The job's record of its newest checkpoint counts only as written.
    let marker = job.join(weir_io::COMPLETED_FILE);
    assert_eq!(st.completed_marker(), Some(4));
    for id in ["04", "+4"] {
        let crc = crc32fast::hash(id.as_bytes());
        std::fs::write(&marker, format!("{id} {crc:08x}\n")).unwrap();
        assert_eq!(st.completed_marker(), None, "{id}");
    }
    let crc = crc32fast::hash(b"4");
    std::fs::write(&marker, format!("4 {crc:08X}\n")).unwrap();
    assert_eq!(st.completed_marker(), None, "upper-case CRC");
    std::fs::write(&marker, format!("4 {crc:08x}\n")).unwrap();
    assert_eq!(st.completed_marker(), Some(4));
    std::fs::remove_file(&marker).unwrap();
    assert_eq!(st.completed_record().unwrap(), None, "missing");
}

#[test]
fn gc_spares_an_older_checkpoint_still_in_progress() {
    let tmp = tempfile::tempdir().unwrap();
    let (root, local) = (tmp.path().join("c"), tmp.path().join("l"));
    let st = open(Arc::new(StdFs), &root);
    let job = st.job_dir().to_owned();
    let c1 = write_checkpoint(&st, 1, &local, None).unwrap();
    // Checkpoint 2 is slow: it reuses checkpoint 1's segment and writes its own files while
    // checkpoint 3 completes and GC drops checkpoint 1.
    let p2 = st.begin(2).unwrap();
    let mut w2 = p2.writer();
    w2.reuse_shared(&c1.metadata.files[0]).unwrap();
    let l2 = w2.write_small(b"slow", SmallFileKind::TaskOwned).unwrap();
    let c3 = write_checkpoint(&st, 3, &local, None).unwrap();
    let r = st.retain(1).unwrap();
    assert_eq!(r.dropped_checkpoints, vec![1]);
    assert!(job.join(&c1.metadata.files[0].path).exists(), "reused by 2");
    assert!(job.join(&l2.physical).exists(), "created by 2");
    // Checkpoint 1's own files went (not only nothing at all), and none of another's.
    assert!(!r.deleted_files.is_empty(), "checkpoint 1's unshared files");
    assert!(r
        .deleted_files
        .iter()
        .all(|p| c1.metadata.physical_paths().contains(p)));
    w2.finish().unwrap();
    st.commit(p2, info(2)).unwrap();
    st.verify(2).unwrap();
    st.verify(3).unwrap();
    assert_eq!(st.latest_complete().unwrap().unwrap().id, 3);
    assert!(matches!(st.begin(3), Err(CheckpointError::StaleId { .. })));
    // Once 2 is no longer in progress, keeping one checkpoint drops it and its files.
    st.retain(1).unwrap();
    let on_disk: BTreeSet<PathBuf> = data_files(&job).into_iter().map(|(p, _)| p).collect();
    assert_eq!(on_disk, c3.metadata.physical_paths());
}

#[test]
fn a_pinned_checkpoint_outlives_retention_until_its_pin_drops() {
    let tmp = tempfile::tempdir().unwrap();
    let (root, local) = (tmp.path().join("c"), tmp.path().join("l"));
    let st = open(Arc::new(StdFs), &root);
    let job = st.job_dir().to_owned();
    let c1 = write_checkpoint(&st, 1, &local, None).unwrap();
    assert!(
        st.pin(7).is_err(),
        "only a complete checkpoint can be pinned"
    );
    let pin = st.pin(1).unwrap();
    let again = st.pin(1).unwrap();
    assert_eq!(pin.checkpoint_id(), 1);
    let c2 = write_checkpoint(&st, 2, &local, None).unwrap();
    let r = st.retain(1).unwrap();
    assert!(r.dropped_checkpoints.is_empty(), "{r:?}");
    st.verify(1).unwrap();
    // A savepoint copied out of the pinned checkpoint while newer ones complete.
    let c3 = write_checkpoint(&st, 3, &local, None).unwrap();
    assert_eq!(st.retain(1).unwrap().dropped_checkpoints, vec![2]);
    let sp = pin
        .export_savepoint(&tmp.path().join("sp"), "savepoint-1")
        .unwrap();
    let opened = weir_io::Savepoint::open(Arc::new(StdFs), &sp).unwrap();
    opened.verify().unwrap();
    assert_eq!(opened.metadata().files, c1.metadata.files);
    // Two pins: the checkpoint stays until the last goes.
    drop(pin);
    assert!(st.retain(1).unwrap().dropped_checkpoints.is_empty());
    drop(again);
    let r = st.retain(1).unwrap();
    assert_eq!(r.dropped_checkpoints, vec![1]);
    let on_disk: BTreeSet<PathBuf> = data_files(&job).into_iter().map(|(p, _)| p).collect();
    assert_eq!(on_disk, c3.metadata.physical_paths());
    assert!(!job.join("chk-2").exists() && c2.metadata.checkpoint_id == 2);
}

#[test]
fn commit_fails_when_a_reused_file_is_gone() {
    let tmp = tempfile::tempdir().unwrap();
    let (root, local) = (tmp.path().join("c"), tmp.path().join("l"));
    let st = open(Arc::new(StdFs), &root);
    let c1 = write_checkpoint(&st, 1, &local, None).unwrap();
    let p = st.begin(2).unwrap();
    let mut w = p.writer();
    w.reuse_shared(&c1.metadata.files[0]).unwrap();
    w.finish().unwrap();
    std::fs::remove_file(st.job_dir().join(&c1.metadata.files[0].path)).unwrap();
    assert!(matches!(
        st.commit(p, info(2)),
        Err(CheckpointError::MissingReusedFile { .. })
    ));
    assert_eq!(st.latest_complete().unwrap().unwrap().id, 1);
}

/// A reuse checks that the file is there and holds it against retention from then on, under
/// the GC lock: with concurrent checkpoints, retention after one of them completed dropped a
/// file that another had decided to reuse, and that one failed at its commit. A file already
/// gone is `MissingReusedFile` at the reuse (the caller uploads instead), and a file reused
/// by an in-progress checkpoint survives a retention that drops every checkpoint holding it.
#[test]
fn a_reuse_holds_its_file_against_retention_and_refuses_a_file_gone() {
    let tmp = tempfile::tempdir().unwrap();
    let (root, local) = (tmp.path().join("c"), tmp.path().join("l"));
    let st = open(Arc::new(StdFs), &root);
    let c1 = write_checkpoint(&st, 1, &local, None).unwrap();
    let kept = &c1.metadata.files[0];
    let p3 = st.begin(3).unwrap();
    let mut w = p3.writer();
    w.reuse_shared(kept).unwrap();
    w.finish().unwrap();
    // Checkpoint 2 (complete, sharing nothing with 1) makes retention drop 1.
    write_checkpoint(&st, 2, &local, None).unwrap();
    let r = st.retain(1).unwrap();
    assert_eq!(r.dropped_checkpoints, vec![1]);
    assert!(
        st.job_dir().join(&kept.path).exists(),
        "held by checkpoint 3"
    );
    st.commit(p3, info(3)).unwrap();
    // Gone before the reuse: refused there, not at the commit.
    std::fs::remove_file(st.job_dir().join(&kept.path)).unwrap();
    let p4 = st.begin(4).unwrap();
    let mut w = p4.writer();
    assert!(matches!(
        w.reuse_shared(kept),
        Err(CheckpointError::MissingReusedFile {
            checkpoint_id: 4,
            ..
        })
    ));
    w.finish().unwrap();
    st.commit(p4, info(4)).unwrap();
}

/// A savepoint export that fails part way (a directory's fsync, the metadata's write or
/// fsync) leaves no directory behind: before, the partial copy stayed in the savepoint root
/// beside real savepoints. One that succeeds verifies, also where a hard link failed and the
/// file was copied instead.
#[test]
fn a_failed_savepoint_export_leaves_no_directory() {
    let tmp = tempfile::tempdir().unwrap();
    let (root, local) = (tmp.path().join("c"), tmp.path().join("l"));
    let c1 = write_checkpoint(&open(Arc::new(StdFs), &root), 1, &local, None).unwrap();
    write_checkpoint(&open(Arc::new(StdFs), &root), 2, &local, Some(&c1.metadata)).unwrap();
    // Past the last step of an export, every kind succeeds.
    let (mut failed, mut clean_steps) = (0, 0);
    for step in 0..200 {
        let sp_root = tmp.path().join(format!("sp{step}"));
        let mut done = true;
        for kind in 0..4 {
            let at = Some(step);
            // A failed hard link falls back to a copy, whose faults the other kinds inject.
            let fs = FaultyFs::new(FaultConfig {
                fail_sync_at_step: at.filter(|_| kind == 0),
                tear_write_at_step: at.filter(|_| kind == 1),
                fail_sync_dir_at_step: at.filter(|_| kind == 2),
                fail_link_at_step: at.filter(|_| kind == 3),
                ..FaultConfig::default()
            });
            let st =
                CheckpointStorage::open_read_only_with(Arc::new(fs), &root, "job", OPTS).unwrap();
            std::fs::create_dir_all(&sp_root).unwrap();
            let name = format!("sp{kind}");
            match st.export_savepoint(2, &sp_root, &name) {
                Ok(dir) => {
                    Savepoint::open(Arc::new(StdFs), &dir)
                        .unwrap()
                        .verify()
                        .unwrap();
                    assert!(!dir.join(".links").exists(), "the staging links went");
                }
                Err(e) => {
                    done = false;
                    failed += 1;
                    assert!(
                        !sp_root.join(&name).exists(),
                        "step {step}, kind {kind}: {e}: a partial savepoint was left"
                    );
                }
            }
        }
        clean_steps = if done { clean_steps + 1 } else { 0 };
        if clean_steps == 20 {
            break;
        }
    }
    assert_eq!(clean_steps, 20, "exports past the faults' steps succeed");
    assert!(failed > 10, "faults were injected: {failed}");
}

#[test]
fn savepoint_is_self_contained() {
    let tmp = tempfile::tempdir().unwrap();
    let (root, local) = (tmp.path().join("c"), tmp.path().join("l"));
    let sp_root = tmp.path().join("savepoints");
    let fs: Arc<dyn Fs> = Arc::new(StdFs);
    let st = open(fs.clone(), &root);
    let c1 = write_checkpoint(&st, 1, &local, None).unwrap();
    let c2 = write_checkpoint(&st, 2, &local, Some(&c1.metadata)).unwrap();
    let contents: Vec<Vec<u8>> = c2
        .metadata
        .files
        .iter()
        .map(|f| st.read_file(f).unwrap())
        .chain(
            c2.metadata
                .logical_files
                .iter()
                .map(|l| st.read_logical(l).unwrap()),
        )
        .collect();
    let dir = st.export_savepoint(2, &sp_root, "before-upgrade").unwrap();
    assert!(matches!(
        st.export_savepoint(2, &sp_root, "before-upgrade"),
        Err(CheckpointError::AlreadyExists { .. })
    ));
    assert!(st.export_savepoint(2, &sp_root, "../escape").is_err());
    // Not where retention deletes: in the job's directory, or one of its checkpoints'.
    let job = st.job_dir().to_owned();
    for inside in [job.clone(), job.join("chk-1"), job.join("x").join("..")] {
        assert!(
            matches!(
                st.export_savepoint(2, &inside, "sp"),
                Err(CheckpointError::InvalidArgument {
                    what: "savepoint directory",
                    ..
                })
            ),
            "{}",
            inside.display()
        );
        assert!(!inside.join("sp").exists());
    }
    assert_eq!(st.latest_complete().unwrap().unwrap().id, 2);
    drop(st);
    std::fs::remove_dir_all(&job).unwrap();

    let sp = Savepoint::open(fs.clone(), &dir).unwrap();
    assert_eq!(sp.metadata().kind, CheckpointKind::Savepoint);
    assert_eq!(sp.metadata().checkpoint_id, 2);
    assert_eq!(sp.metadata().files, c2.metadata.files);
    let r = sp.verify().unwrap();
    assert_eq!(r.files, c2.metadata.files.len());
    let again: Vec<Vec<u8>> = sp
        .metadata()
        .files
        .iter()
        .map(|f| sp.read_file(f).unwrap())
        .chain(
            sp.metadata()
                .logical_files
                .iter()
                .map(|l| sp.read_logical(l).unwrap()),
        )
        .collect();
    assert_eq!(again, contents);

    // A corrupt savepoint file is named.
    let f = &sp.metadata().files[0];
    FaultyFs::flip_bit(&dir.join(&f.path), DATA_HEADER_LEN as u64 + 30, 1).unwrap();
    let e = sp.verify().unwrap_err();
    assert_eq!(e.format_error().unwrap().file(), dir.join(&f.path));
}

/// The hex fixture in docs/checkpoint-format.md decodes to the documented values, and the
/// encoder reproduces it byte for byte.
/// The hex fixture after `marker` in docs/checkpoint-format.md.
fn doc_fixture(marker: &str) -> Vec<u8> {
    let doc = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/checkpoint-format.md"),
    )
    .unwrap();
    let start = doc.find(marker).expect("fixture marker");
    let block = &doc[start..];
    let block = &block[block.find("```text").unwrap() + 7..];
    let block = &block[..block.find("```").unwrap()];
    let mut fixture = Vec::new();
    for line in block.lines() {
        // "0000: 57 45 ..." : offset column, then bytes.
        let Some((_, hex)) = line.split_once(':') else {
            continue;
        };
        for b in hex.split_whitespace() {
            fixture.push(u8::from_str_radix(b, 16).unwrap());
        }
    }
    fixture
}

/// What both fixtures hold, with `files`.
fn fixture_metadata(files: Vec<FileRef>) -> CheckpointMetadata {
    CheckpointMetadata {
        job_id: "job-a".into(),
        checkpoint_id: 3,
        kind: CheckpointKind::Checkpoint,
        trigger_timestamp_ms: 1_700_000_000_000,
        completion_timestamp_ms: 1_700_000_000_250,
        new_bytes: 1234,
        files,
        logical_files: vec![LogicalFileRef {
            physical: "taskowned/3-00000001000000ab-merged".into(),
            offset: 40,
            size_bytes: 5,
            first_block: 0,
            crc32: 0x5566_7788,
        }],
        sections: vec![("src".into(), vec![1, 2])],
    }
}

fn framed_fixture_file() -> FileRef {
    FileRef {
        path: "shared/2-00000001000000aa-seg".into(),
        size_bytes: 4096,
        crc32: 0x1122_3344,
    }
}

/// The current version's fixture decodes and the encoder reproduces it byte for byte.
#[test]
fn doc_fixture_decodes() {
    let fixture = doc_fixture("<!-- fixture:metadata -->");
    let m = CheckpointMetadata::decode(Path::new("fixture"), &fixture).unwrap();
    let expect = fixture_metadata(vec![
        framed_fixture_file(),
        FileRef {
            path: "shared/3-00000001000000ac-raw-seg".into(),
            size_bytes: 8192,
            crc32: 0x99aa_bbcc,
        },
    ]);
    assert_eq!(m, expect);
    assert_eq!(expect.encode(), fixture);
}

/// Version 1 (before raw files) still decodes; a version 1 metadata that names a raw file is
/// malformed, at that file's entry.
#[test]
fn doc_fixture_of_version_1_decodes() {
    let mut fixture = doc_fixture("<!-- fixture:metadata-v1 -->");
    assert_eq!(fixture[8], 1, "version 1");
    let m = CheckpointMetadata::decode(Path::new("fixture"), &fixture).unwrap();
    assert_eq!(m, fixture_metadata(vec![framed_fixture_file()]));
    // The current encoding of a metadata naming a raw file, labelled version 1 (CRC fixed).
    fixture = fixture_metadata(vec![FileRef {
        path: "shared/3-00000001000000ac-raw-seg".into(),
        size_bytes: 8192,
        crc32: 0x99aa_bbcc,
    }])
    .encode();
    fixture[8] = 1;
    let n = fixture.len() - 4;
    let crc = weir_io::crc32(&[&fixture[..n]]);
    fixture[n..].copy_from_slice(&crc.to_le_bytes());
    // Header 16, three timestamps and the new bytes 32, the job id 2 + 5, the count 4.
    let e = CheckpointMetadata::decode(Path::new("fixture"), &fixture).unwrap_err();
    assert!(
        matches!(&e, FormatError::Malformed { offset: 59, .. }),
        "{e}"
    );
}

#[test]
fn thread_safety_of_the_api() {
    fn send_sync<T: Send + Sync>() {}
    fn send<T: Send>() {}
    send_sync::<CheckpointStorage>();
    send_sync::<weir_io::PendingCheckpoint>();
    send::<weir_io::CheckpointWriter>();
}

/// The production file system: the same round trip through io_uring (skipped where the
/// sandbox forbids io_uring, with a message).
#[test]
fn round_trip_through_uring() {
    let fs = match weir_io::UringFs::new() {
        Ok(fs) => fs,
        Err(e) => {
            // Failing rather than passing having checked nothing, unless asked to skip.
            assert!(
                std::env::var_os("WEIR_ALLOW_NO_URING").is_some(),
                "{e} (set WEIR_ALLOW_NO_URING=1 to skip the io_uring tests)"
            );
            eprintln!("skipping: {e}");
            return;
        }
    };
    let tmp = tempfile::tempdir().unwrap();
    let (root, local) = (tmp.path().join("c"), tmp.path().join("l"));
    let st = open(Arc::new(fs), &root);
    let c1 = write_checkpoint(&st, 1, &local, None).unwrap();
    let c2 = write_checkpoint(&st, 2, &local, Some(&c1.metadata)).unwrap();
    st.verify(2).unwrap();
    read_all_refs(&st, &c2.metadata);
    st.retain(1).unwrap();
    st.verify(2).unwrap();
}

/// `copy_file_to` streams a verified copy (across several reads of a multi-megabyte file),
/// and a flipped bit anywhere in the file header, a block header or a payload fails the copy
/// naming the checkpoint file and the offset of what failed, leaving no copy behind.
#[test]
fn copy_file_to_verifies_every_block_and_leaves_nothing_on_error() {
    let tmp = tempfile::tempdir().unwrap();
    let (root, local) = (tmp.path().join("c"), tmp.path().join("l"));
    let st = open(Arc::new(StdFs), &root);
    let job = st.job_dir().to_owned();
    // 5 MB in 1 000-byte blocks: more than one 4 MiB read.
    let content = bytes(5_000_123, 42);
    let seg = local.join("big");
    std::fs::create_dir_all(&local).unwrap();
    std::fs::write(&seg, &content).unwrap();
    let p = st.begin(1).unwrap();
    let mut w = p.writer();
    let f = w.upload_shared(&seg, "seg").unwrap();
    w.finish().unwrap();
    let c = st.commit(p, info(1)).unwrap();
    let sp_dir = st
        .export_savepoint(1, &tmp.path().join("sp"), "one")
        .unwrap();
    let sp = Savepoint::open(Arc::new(StdFs), &sp_dir).unwrap();
    let dest = tmp.path().join("copy");
    assert_eq!(st.copy_file_to(&f, &dest).unwrap(), content.len() as u64);
    assert_eq!(std::fs::read(&dest).unwrap(), content);
    std::fs::remove_file(&dest).unwrap();
    assert_eq!(
        sp.copy_file_to(&c.metadata.files[0], &dest).unwrap(),
        content.len() as u64
    );
    assert_eq!(std::fs::read(&dest).unwrap(), content);
    // The destination must be new: an existing file is never overwritten.
    assert!(st.copy_file_to(&f, &dest).is_err());
    assert_eq!(std::fs::read(&dest).unwrap(), content);
    std::fs::remove_file(&dest).unwrap();

    let fpath = job.join(&f.path);
    let frame = BLOCK_HEADER + 1_000;
    let last_block = (content.len() as u64 - 1) / 1_000;
    let at = |b: u64| DATA_HEADER_LEN as u64 + b * frame;
    // (byte flipped, offset the error must name)
    let cases = [
        (3, 0),                              // file header magic
        (36, 0),                             // file header CRC
        (at(0) + 2, at(0)),                  // first block header (file id)
        (at(0) + BLOCK_HEADER + 999, at(0)), // first block payload
        (at(4_200) + 20, at(4_200)),         // a block past the first read's end
        (at(4_200) + BLOCK_HEADER, at(4_200)),
        (at(last_block) + BLOCK_HEADER + 5, at(last_block)),
    ];
    for (flip, want) in cases {
        FaultyFs::flip_bit(&fpath, flip, 1).unwrap();
        let e = expect_format(st.copy_file_to(&f, &dest));
        assert_eq!(
            (e.file(), e.offset()),
            (fpath.as_path(), want),
            "flip at {flip}: {e}"
        );
        assert!(
            !dest.exists(),
            "flip at {flip}: a failed copy left {}",
            dest.display()
        );
        FaultyFs::flip_bit(&fpath, flip, 1).unwrap();
    }
    // Truncated: the copy fails before writing anything it cannot verify.
    let good = std::fs::read(&fpath).unwrap();
    std::fs::write(&fpath, &good[..good.len() - 10]).unwrap();
    let e = expect_format(st.copy_file_to(&f, &dest));
    assert!(
        matches!(&e, FormatError::Truncated { file, .. } if *file == fpath),
        "{e}"
    );
    assert!(!dest.exists());
    std::fs::write(&fpath, &good).unwrap();
    st.copy_file_to(&f, &dest).unwrap();
    assert_eq!(std::fs::read(&dest).unwrap(), content);
}

/// Verification checks files on several threads, largest first, yet reports what a check in
/// metadata order would: the first corrupt file in that order, with its offset.
#[test]
fn parallel_verification_reports_the_first_corrupt_file_in_metadata_order() {
    let tmp = tempfile::tempdir().unwrap();
    let (root, local) = (tmp.path().join("c"), tmp.path().join("l"));
    let st = open(Arc::new(StdFs), &root);
    let job = st.job_dir().to_owned();
    let p = st.begin(1).unwrap();
    let mut w = p.writer();
    for i in 0..12u64 {
        let seg = segment(&local, &format!("seg{i}"), 1_000 + 3_000 * i as usize, i);
        w.upload_shared(&seg, &format!("seg{i}")).unwrap();
    }
    w.finish().unwrap();
    let m = st.commit(p, info(1)).unwrap().metadata;
    let report = st.verify(1).unwrap();
    assert_eq!(report.files, 12);
    // Corrupt a small file early in metadata order and the largest file, which is checked
    // first.
    let by_size = |f: &&FileRef| f.size_bytes;
    let largest = m.files.iter().max_by_key(by_size).unwrap();
    let early = m.files.iter().find(|f| f.path != largest.path).unwrap();
    let first_in_order = m
        .files
        .iter()
        .position(|f| f.path == early.path || f.path == largest.path)
        .unwrap();
    let want = &m.files[first_in_order];
    assert_ne!(
        want.path, largest.path,
        "the largest file comes later in metadata order"
    );
    for f in [early, largest] {
        FaultyFs::flip_bit(
            &job.join(&f.path),
            DATA_HEADER_LEN as u64 + BLOCK_HEADER + 9,
            4,
        )
        .unwrap();
    }
    for _ in 0..5 {
        let e = expect_corrupt(st.verify(1));
        assert_eq!(e.file(), job.join(&want.path));
        assert_eq!(e.offset(), DATA_HEADER_LEN as u64);
    }
}

fn inode(p: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(p).unwrap().ino()
}

/// A raw upload is a second name of the source: no bytes copied, the content's length and CRC
/// in the reference; reads, verification, savepoints and restore copies check those, and a
/// restore copy is a link too.
#[test]
fn raw_uploads_link_the_source_and_are_verified_like_framed_ones() {
    let tmp = tempfile::tempdir().unwrap();
    let (root, local) = (tmp.path().join("c"), tmp.path().join("l"));
    let st = CheckpointStorage::open_with(Arc::new(StdFs), &root, "job", RAW_OPTS).unwrap();
    let job = st.job_dir().to_owned();
    let content = bytes(5_000_123, 7);
    std::fs::create_dir_all(&local).unwrap();
    let seg = local.join("big");
    std::fs::write(&seg, &content).unwrap();
    let p = st.begin(1).unwrap();
    let mut w = p.writer();
    let f = w.upload_shared(&seg, "s0-seg").unwrap();
    w.finish().unwrap();
    let c = st.commit(p, info(1)).unwrap();
    let fpath = job.join(&f.path);
    let name = f.path.file_name().unwrap().to_str().unwrap().to_owned();
    assert!(
        name.starts_with("1-") && name.ends_with("-raw-s0seg"),
        "{name}"
    );
    assert_eq!(inode(&fpath), inode(&seg), "linked, not copied");
    assert_eq!(
        (f.size_bytes, f.crc32),
        (content.len() as u64, weir_io::crc32(&[&content]))
    );
    assert_eq!(std::fs::metadata(&fpath).unwrap().len(), f.size_bytes);
    assert_eq!(c.metadata.new_bytes, f.size_bytes);
    assert_eq!(st.read_file(&f).unwrap(), content);
    assert_eq!(st.verify(1).unwrap().bytes_checked, f.size_bytes);
    // A restore copy links as well; a savepoint copies the bytes and keeps the name.
    let dest = tmp.path().join("restored");
    assert_eq!(st.copy_file_to(&f, &dest).unwrap(), f.size_bytes);
    assert_eq!(inode(&dest), inode(&fpath));
    std::fs::remove_file(&dest).unwrap();
    let sp_dir = st
        .export_savepoint(1, &tmp.path().join("sp"), "one")
        .unwrap();
    let sp = Savepoint::open(Arc::new(StdFs), &sp_dir).unwrap();
    assert_ne!(
        inode(&sp_dir.join(&f.path)),
        inode(&fpath),
        "self-contained"
    );
    assert_eq!(sp.read_file(&f).unwrap(), content);
    // Dropping the source's name leaves the checkpoint's.
    std::fs::remove_file(&seg).unwrap();
    assert_eq!(st.read_file(&f).unwrap(), content);

    // A flipped bit anywhere fails the content CRC; the error names the file, offset 0.
    for flip in [0u64, 4_194_400, content.len() as u64 - 1] {
        FaultyFs::flip_bit(&fpath, flip, 3).unwrap();
        let e = expect_corrupt(st.verify(1));
        assert!(
            matches!(&e, FormatError::ChecksumMismatch { file, offset: 0, .. } if *file == fpath),
            "flip at {flip}: {e}"
        );
        let e = expect_format(st.copy_file_to(&f, &dest));
        assert!(matches!(e, FormatError::ChecksumMismatch { .. }), "{e}");
        assert!(
            !dest.exists(),
            "a failed restore copy left {}",
            dest.display()
        );
        FaultyFs::flip_bit(&fpath, flip, 3).unwrap();
    }
    // Shorter or longer than the reference: named with the offset where they differ.
    let good = std::fs::read(&fpath).unwrap();
    std::fs::write(&fpath, &good[..good.len() - 10]).unwrap();
    let e = expect_format(st.read_file(&f));
    assert!(
        matches!(&e, FormatError::Truncated { file, offset, .. }
            if *file == fpath && *offset == f.size_bytes - 10),
        "{e}"
    );
    let mut longer = good.clone();
    longer.push(0);
    std::fs::write(&fpath, &longer).unwrap();
    let e = expect_format(st.read_file(&f));
    assert!(
        matches!(&e, FormatError::Malformed { offset, .. } if *offset == f.size_bytes),
        "{e}"
    );
    std::fs::write(&fpath, &good).unwrap();
    st.verify(1).unwrap();
}

/// `link_file_to` gives a raw file a second name once its length is checked, without reading
/// it (its caller's reader checks the bytes); a framed file it copies, verified as
/// `copy_file_to` does, and a savepoint's files the same way.
#[test]
fn link_file_to_links_raw_files_by_length_and_copies_framed_ones_verified() {
    let tmp = tempfile::tempdir().unwrap();
    let local = tmp.path().join("l");
    std::fs::create_dir_all(&local).unwrap();
    let content = bytes(70_000, 9);
    for opts in [RAW_OPTS, OPTS] {
        // Anew each time: the raw checkpoint file below is a second name of it.
        let src = local.join(if opts.link_uploads { "raw-seg" } else { "seg" });
        std::fs::write(&src, &content).unwrap();
        let root = tmp
            .path()
            .join(if opts.link_uploads { "raw" } else { "framed" });
        let st = CheckpointStorage::open_with(Arc::new(StdFs), &root, "job", opts).unwrap();
        let p = st.begin(1).unwrap();
        let mut w = p.writer();
        let f = w.upload_shared(&src, "seg").unwrap();
        w.finish().unwrap();
        st.commit(p, info(1)).unwrap();
        let fpath = st.job_dir().join(&f.path);
        let dest = tmp.path().join("dest");
        assert_eq!(st.link_file_to(&f, &dest).unwrap(), content.len() as u64);
        assert_eq!(std::fs::read(&dest).unwrap(), content);
        assert_eq!(inode(&dest) == inode(&fpath), opts.link_uploads);
        std::fs::remove_file(&dest).unwrap();
        let sp_dir = st
            .export_savepoint(
                1,
                &tmp.path().join("sp"),
                &format!("sp{}", opts.link_uploads),
            )
            .unwrap();
        let sp = Savepoint::open(Arc::new(StdFs), &sp_dir).unwrap();
        assert_eq!(sp.link_file_to(&f, &dest).unwrap(), content.len() as u64);
        assert_eq!(std::fs::read(&dest).unwrap(), content);
        std::fs::remove_file(&dest).unwrap();
        // A flipped bit: a framed copy checks its blocks; a raw link does not read.
        FaultyFs::flip_bit(&fpath, fpath.metadata().unwrap().len() / 2, 1).unwrap();
        if opts.link_uploads {
            st.link_file_to(&f, &dest).unwrap();
            std::fs::remove_file(&dest).unwrap();
        } else {
            let e = expect_format(st.link_file_to(&f, &dest));
            assert!(matches!(e, FormatError::ChecksumMismatch { .. }), "{e}");
            assert!(!dest.exists());
        }
        // A length other than the reference's is refused either way, naming the file.
        let good = std::fs::read(&fpath).unwrap();
        std::fs::write(&fpath, &good[..good.len() - 1]).unwrap();
        let e = expect_format(st.link_file_to(&f, &dest));
        assert!(
            matches!(&e, FormatError::Truncated { file, .. } if *file == fpath),
            "{e}"
        );
        assert!(!dest.exists());
    }
}

/// A toy file format for [`raw_files_failing_their_crc_are_located_by_their_owner`]: no byte
/// may be 0xff. Its "check" names the first one.
fn no_ff_diagnose(fs: &dyn weir_io::Fs, path: &Path) -> Option<FormatError> {
    let f = fs.open(path).ok()?;
    let mut b = vec![0u8; f.len().ok()? as usize];
    f.read_at(0, &mut b).ok()?;
    let at = b.iter().position(|&x| x == 0xff)?;
    Some(FormatError::Malformed {
        file: path.to_owned(),
        offset: at as u64,
        reason: "0xff byte".into(),
    })
}

/// A raw file whose whole-file CRC fails is handed to `StorageOptions::raw_diagnose`, and
/// the error of its own format (with the damaged part's offset) replaces the mismatch at
/// offset 0, in every read: verify, read, restore copy, read-only storage, savepoint. Where
/// the diagnosis finds nothing, or there is none, the mismatch at offset 0 stays.
#[test]
fn raw_files_failing_their_crc_are_located_by_their_owner() {
    let tmp = tempfile::tempdir().unwrap();
    let (root, local) = (tmp.path().join("c"), tmp.path().join("l"));
    let opts = StorageOptions {
        raw_diagnose: Some(no_ff_diagnose),
        ..RAW_OPTS
    };
    let content: Vec<u8> = bytes(300_000, 5).iter().map(|b| b & 0x7f).collect();
    std::fs::create_dir_all(&local).unwrap();
    let src = local.join("seg");
    std::fs::write(&src, &content).unwrap();
    let st = CheckpointStorage::open_with(Arc::new(StdFs), &root, "job", opts).unwrap();
    let p = st.begin(1).unwrap();
    let mut w = p.writer();
    let f = w.upload_shared(&src, "seg").unwrap();
    w.finish().unwrap();
    st.commit(p, info(1)).unwrap();
    let sp_dir = st
        .export_savepoint(1, &tmp.path().join("sp"), "one")
        .unwrap();
    let fpath = st.job_dir().join(&f.path);
    let sp_path = sp_dir.join(&f.path);
    let ro = CheckpointStorage::open_read_only_with(Arc::new(StdFs), &root, "job", opts).unwrap();
    let plain = CheckpointStorage::open_read_only(Arc::new(StdFs), &root, "job").unwrap();
    let sp = Savepoint::open(Arc::new(StdFs), &sp_dir)
        .unwrap()
        .with_raw_diagnose(no_ff_diagnose);
    let dest = tmp.path().join("restored");
    let at = 123_457u64;
    let located = |e: &FormatError, file: &Path| matches!(e, FormatError::Malformed { file: f, offset, .. } if f == file && *offset == at);
    // Damage the format can see: the offset is the damaged byte's.
    for path in [&fpath, &sp_path] {
        let mut b = std::fs::read(path).unwrap();
        b[at as usize] = 0xff;
        std::fs::write(path, &b).unwrap();
    }
    for e in [
        expect_corrupt(st.verify(1)),
        expect_format(st.read_file(&f)),
        expect_format(st.copy_file_to(&f, &dest)),
        expect_corrupt(ro.verify(1)),
    ] {
        assert!(located(&e, &fpath), "{e}");
    }
    assert!(!dest.exists());
    for e in [expect_corrupt(sp.verify()), expect_format(sp.read_file(&f))] {
        assert!(located(&e, &sp_path), "{e}");
    }
    // Without a diagnosis the mismatch stays at offset 0.
    let e = expect_corrupt(plain.verify(1));
    assert!(
        matches!(&e, FormatError::ChecksumMismatch { offset: 0, .. }),
        "{e}"
    );
    // Damage the format cannot see: the diagnosis finds nothing, offset 0 again.
    let mut b = std::fs::read(&fpath).unwrap();
    b[at as usize] = 0x01 ^ content[at as usize];
    std::fs::write(&fpath, &b).unwrap();
    let e = expect_corrupt(st.verify(1));
    assert!(
        matches!(&e, FormatError::ChecksumMismatch { file, offset: 0, .. } if *file == fpath),
        "{e}"
    );
}

/// An upload with the size and CRC its writer computed: a raw upload records them without
/// reading the file, so a file that no longer holds what its writer wrote is caught by
/// verification (not vouched for with a CRC of its new bytes); a copy compares them with what
/// it copied; a size that differs fails either way. Each error names the file.
#[test]
fn uploads_with_the_writers_crc_record_it_and_a_copy_checks_it() {
    let tmp = tempfile::tempdir().unwrap();
    let (root, local) = (tmp.path().join("c"), tmp.path().join("l"));
    let content = bytes(20_000, 11);
    let crc = weir_io::crc32(&[&content]);
    let seg = segment(&local, "s", 20_000, 11);
    for opts in [RAW_OPTS, OPTS] {
        let _ = std::fs::remove_dir_all(&root);
        let st = CheckpointStorage::open_with(Arc::new(StdFs), &root, "job", opts).unwrap();
        // Right size and CRC: the same reference as an upload that reads the file.
        let p = st.begin(1).unwrap();
        let mut w = p.writer();
        let f = w.upload_shared_known(&seg, "seg", 20_000, crc).unwrap();
        w.finish().unwrap();
        st.commit(p, info(1)).unwrap();
        assert_eq!((f.size_bytes, f.crc32), (20_000, crc));
        assert_eq!(st.read_file(&f).unwrap(), content);
        st.verify(1).unwrap();
        // A size other than the writer's.
        let p = st.begin(2).unwrap();
        let mut w = p.writer();
        let e = w.upload_shared_known(&seg, "seg", 20_001, crc).unwrap_err();
        assert!(
            matches!(&e, CheckpointError::Format(FormatError::Malformed { file, offset: 20_000, .. })
                if *file == seg),
            "{e}"
        );
        drop(w);
        st.abort(p).unwrap();
        // A CRC other than the writer's (the file changed after it was written).
        let p = st.begin(3).unwrap();
        let mut w = p.writer();
        let r = w.upload_shared_known(&seg, "seg", 20_000, crc ^ 1);
        if opts.link_uploads {
            let f = r.unwrap();
            w.finish().unwrap();
            st.commit(p, info(3)).unwrap();
            assert_eq!(f.crc32, crc ^ 1, "the writer's CRC, not the file's");
            let e = expect_corrupt(st.verify(3));
            assert!(
                matches!(&e, FormatError::ChecksumMismatch { expected, actual, .. }
                    if *expected == crc ^ 1 && *actual == crc),
                "{e}"
            );
        } else {
            let e = r.unwrap_err();
            assert!(
                matches!(&e, CheckpointError::Format(FormatError::ChecksumMismatch { file, offset: 0, .. })
                    if *file == seg),
                "{e}"
            );
            drop(w);
            st.abort(p).unwrap();
        }
    }
}

/// Where the file system cannot link, a raw upload falls back to a framed copy, and a raw
/// file's restore copy to a verified byte copy.
#[test]
fn raw_uploads_fall_back_to_copies_without_links() {
    #[derive(Debug)]
    struct NoLinks;
    impl Fs for NoLinks {
        fn create(&self, p: &Path) -> Result<Box<dyn weir_io::FsFile>, weir_io::IoError> {
            StdFs.create(p)
        }
        fn open(&self, p: &Path) -> Result<Box<dyn weir_io::FsFile>, weir_io::IoError> {
            StdFs.open(p)
        }
        fn rename(&self, a: &Path, b: &Path) -> Result<(), weir_io::IoError> {
            StdFs.rename(a, b)
        }
        fn sync_dir(&self, d: &Path) -> Result<(), weir_io::IoError> {
            StdFs.sync_dir(d)
        }
        fn remove(&self, p: &Path) -> Result<(), weir_io::IoError> {
            StdFs.remove(p)
        }
        fn list_dir(&self, d: &Path) -> Result<Vec<PathBuf>, weir_io::IoError> {
            StdFs.list_dir(d)
        }
        fn create_dir_all(&self, d: &Path) -> Result<(), weir_io::IoError> {
            StdFs.create_dir_all(d)
        }
        fn map_readonly(&self, p: &Path) -> Result<weir_io::Mapped, weir_io::IoError> {
            StdFs.map_readonly(p)
        }
    }
    let tmp = tempfile::tempdir().unwrap();
    let (root, local) = (tmp.path().join("c"), tmp.path().join("l"));
    let content = bytes(3_456, 9);
    std::fs::create_dir_all(&local).unwrap();
    let seg = local.join("s");
    std::fs::write(&seg, &content).unwrap();
    // Written raw (links work), then read through a file system without links.
    let st = CheckpointStorage::open_with(Arc::new(StdFs), &root, "job", RAW_OPTS).unwrap();
    let p = st.begin(1).unwrap();
    let mut w = p.writer();
    let raw = w.upload_shared(&seg, "seg").unwrap();
    w.finish().unwrap();
    let c1 = st.commit(p, info(1)).unwrap();
    drop(st);
    let st = CheckpointStorage::open_with(Arc::new(NoLinks), &root, "job", RAW_OPTS).unwrap();
    let dest = tmp.path().join("restored");
    st.copy_file_to(&raw, &dest).unwrap();
    assert_ne!(inode(&dest), inode(&seg), "copied");
    assert_eq!(std::fs::read(&dest).unwrap(), content);
    // An upload without links is framed.
    let p = st.begin(2).unwrap();
    let mut w = p.writer();
    w.reuse_shared(&c1.metadata.files[0]).unwrap();
    let framed = w.upload_shared(&seg, "seg").unwrap();
    w.finish().unwrap();
    st.commit(p, info(2)).unwrap();
    let name = framed.path.file_name().unwrap().to_str().unwrap();
    assert!(!name.contains("raw-"), "{name}");
    assert_eq!(
        std::fs::metadata(st.job_dir().join(&framed.path))
            .unwrap()
            .len(),
        DATA_HEADER_LEN as u64 + content.len() as u64 + 4 * BLOCK_HEADER,
        "header and four 1 000-byte blocks"
    );
    assert_eq!(st.read_file(&framed).unwrap(), content);
    assert_eq!(st.verify(2).unwrap().files, 2);
}

/// `RUN_ORIGIN` round-trips both kinds of origin, survives a reopen, and any damage to it
/// (each byte flipped, cut short, extended, fields spelt otherwise) is an error naming the
/// file, never another origin.
#[test]
fn the_run_origin_round_trips_and_any_damage_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("ck");
    let st = open(Arc::new(StdFs), &root);
    assert_eq!(st.run_origin().unwrap(), None, "no run recorded yet");
    let from_savepoint = weir_io::RunOrigin {
        first_id: 42,
        restored: Some((17, tmp.path().join("sp dir/savepoint-17"))),
    };
    let from_nothing = weir_io::RunOrigin {
        first_id: 1,
        restored: None,
    };
    for o in [&from_nothing, &from_savepoint] {
        st.record_run_origin(o).unwrap();
        assert_eq!(st.run_origin().unwrap().as_ref(), Some(o));
        let reader = CheckpointStorage::open_read_only_with(Arc::new(StdFs), &root, "job", OPTS);
        assert_eq!(reader.unwrap().run_origin().unwrap().as_ref(), Some(o));
    }
    // A checkpoint of the directory itself is recorded by name, and read back under the
    // directory where it is now.
    let own = weir_io::RunOrigin {
        first_id: 4,
        restored: Some((3, root.join("job").join("chk-3"))),
    };
    st.record_run_origin(&own).unwrap();
    let file = root.join("job").join(weir_io::RUN_ORIGIN_FILE);
    assert!(std::fs::read(&file).unwrap().ends_with(b"\nchk-3"));
    assert_eq!(st.run_origin().unwrap(), Some(own));
    drop(st);
    let moved = tmp.path().join("moved");
    std::fs::rename(&root, &moved).unwrap();
    let st = open(Arc::new(StdFs), &moved);
    assert_eq!(
        st.run_origin().unwrap().and_then(|o| o.restored),
        Some((3, moved.join("job").join("chk-3")))
    );
    std::fs::remove_dir_all(&moved).unwrap();
    let st = open(Arc::new(StdFs), &root);
    st.record_run_origin(&from_savepoint).unwrap();
    let relative = weir_io::RunOrigin {
        first_id: 2,
        restored: Some((1, PathBuf::from("relative/chk-1"))),
    };
    assert!(matches!(
        st.record_run_origin(&relative),
        Err(CheckpointError::InvalidArgument { .. })
    ));
    let good = std::fs::read(&file).unwrap();
    let damaged = |bytes: &[u8]| {
        std::fs::write(&file, bytes).unwrap();
        match st.run_origin() {
            Err(CheckpointError::Format(f)) => assert_eq!(f.file(), file, "{bytes:?}"),
            other => panic!("{:?}: {other:?}", String::from_utf8_lossy(bytes)),
        }
    };
    for i in 0..good.len() {
        for bit in [0, 3, 7] {
            let mut b = good.clone();
            b[i] ^= 1 << bit;
            damaged(&b);
        }
    }
    for cut in 0..good.len() {
        damaged(&good[..cut]);
    }
    let mut longer = good.clone();
    longer.push(b'x');
    damaged(&longer);
    damaged(&vec![b'1'; 9000]);
    // Fields spelt otherwise, each under its own valid CRC.
    let with_crc = |head: &str, path: &[u8]| {
        let crc = weir_io::crc32(&[head.as_bytes(), b"\n", path]);
        let mut b = format!("{head} {crc:08x}\n").into_bytes();
        b.extend_from_slice(path);
        b
    };
    for (head, path) in [
        ("042 17", &b"/sp"[..]),
        ("42 +17", b"/sp"),
        ("42 17", b"sp"),
        ("42 17", b"chk-18"),
        ("42 17", b"./chk-17"),
        ("42 17", b""),
        ("42 -", b"/sp"),
        ("x 17", b"/sp"),
        ("42 17 9", b"/sp"),
    ] {
        damaged(&with_crc(head, path));
    }
    std::fs::write(&file, &good).unwrap();
    assert_eq!(st.run_origin().unwrap().as_ref(), Some(&from_savepoint));
}

/// Retention keeps the checkpoint of its own directory that the last run restored while
/// that run has no complete checkpoint of its own (a restore from `latest` goes back to it),
/// and drops it once the run has one.
#[test]
fn retention_keeps_the_checkpoint_the_last_run_restored_until_it_has_its_own() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("c");
    let local = tmp.path().join("local");
    let st = open(Arc::new(StdFs), &root);
    let mut prev = None;
    for id in 1..=3 {
        prev = Some(
            write_checkpoint(&st, id, &local, prev.as_ref())
                .unwrap()
                .metadata,
        );
    }
    let chk1 = weir_io::resolved_path(&root.join("job").join("chk-1"));
    st.record_run_origin(&weir_io::RunOrigin {
        first_id: 4,
        restored: Some((1, chk1.clone())),
    })
    .unwrap();
    let report = st.retain(1).unwrap();
    assert_eq!(report.dropped_checkpoints, vec![2]);
    st.verify(1).expect("checkpoint 1 and its files are kept");
    st.verify(3).unwrap();
    // The run completes a checkpoint of its own: checkpoint 1 is no longer needed.
    write_checkpoint(&st, 4, &local, prev.as_ref()).unwrap();
    let report = st.retain(1).unwrap();
    assert_eq!(report.dropped_checkpoints, vec![1, 3]);
    st.verify(4).unwrap();
    // A savepoint elsewhere pins nothing here, nor does a record that does not decode.
    st.record_run_origin(&weir_io::RunOrigin {
        first_id: 9,
        restored: Some((4, tmp.path().join("savepoint-4"))),
    })
    .unwrap();
    let m5 = write_checkpoint(&st, 5, &local, None).unwrap().metadata;
    assert_eq!(st.retain(1).unwrap().dropped_checkpoints, vec![4]);
    std::fs::write(root.join("job").join(weir_io::RUN_ORIGIN_FILE), b"5 5 0\n").unwrap();
    write_checkpoint(&st, 6, &local, Some(&m5)).unwrap();
    assert_eq!(st.retain(1).unwrap().dropped_checkpoints, vec![5]);
}
