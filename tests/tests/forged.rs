//! Forged checkpoints: a real checkpoint's `_metadata` with bytes of the runtime's sections
//! changed and its CRC written again, so that only the decoders and checks behind the CRC
//! stand between the change and a restore. A job restored from it fails with an error that is
//! not a panic (a shard's panic is reported as one, and the job must not need it), or it runs
//! to the end; nothing aborts the process. What the sections say of each other (the job
//! section's shard count and format version, the set of shard sections) and which files they
//! reference (only files the metadata lists) is checked: a change to it is always refused, with
//! an error naming the checkpoint, `_metadata`, the section and the field or file. A lowered
//! shard count once ran to the end with wrong results.
//!
//! `WEIR_FORGED_CASES` sets the number of forged checkpoints per job (default 24).

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::{Hold, HELD_BATCH_RECORDS};

use weir_io::CheckpointMetadata;
use weir_runtime::checkpoint::{CheckpointConfig, CheckpointMode, RestartStrategy};
use weir_runtime::source::splitmix64;
use weir_runtime::{
    Job, JobConfig, JobError, JobHandle, Pinning, RestoreFrom, StartError, WatermarkStrategy,
    WindowAssigner,
};

fn cases() -> u64 {
    std::env::var("WEIR_FORGED_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(24)
}

/// `(key, value, index)` records: 37 keys.
fn data(n: u64) -> Vec<(u64, i64, u64)> {
    (0..n)
        .map(|i| (i * 7919 % 37, (i % 13) as i64 - 6, i))
        .collect()
}

/// The jobs whose checkpoints are forged.
#[derive(Clone, Copy, Debug)]
enum Shape {
    /// A source with uid `input`, summed per key by `sum` (keyed state: segments).
    Sum,
    /// Event-time tumbling windows counted per key (window state and timers), then summed per
    /// window start; with unaligned checkpoints, which also hold the records a barrier
    /// overtook, if any.
    Windows,
}

/// The job of `shape` over `data`; with a `hold`, every 200th record 1 ms late and the end
/// held (so that checkpoints complete while it runs).
fn job(shape: Shape, config: JobConfig, data: &[(u64, i64, u64)], hold: Option<Hold>) -> Job {
    let config = match hold {
        Some(_) => config.with_batch_records(HELD_BATCH_RECORDS),
        None => config,
    };
    let job = Job::new(config);
    let input = job
        .from_vec(data.to_vec())
        .uid("input")
        .inspect(move |r: &(u64, i64, u64)| {
            if let Some(hold) = &hold {
                if r.2.is_multiple_of(200) {
                    std::thread::sleep(Duration::from_millis(1));
                }
                hold.delay(r.2);
            }
        });
    match shape {
        Shape::Sum => {
            let _out = input
                .key_by(|r| r.0)
                .reduce(|a, b| (a.0, a.1 + b.1, b.2))
                .uid("sum")
                .collect();
        }
        Shape::Windows => {
            let _out = input
                .assign_timestamps(WatermarkStrategy::bounded_out_of_orderness(
                    5,
                    |r: &(u64, i64, u64)| r.2 as i64,
                ))
                .key_by(|r| r.0)
                .window(WindowAssigner::tumbling(100))
                .count_with(|k, w, n| (*k, w.start, n))
                .uid("count")
                .key_by(|c: &(u64, i64, u64)| c.1 as u64)
                .reduce(|a, b| (a.0, a.1, a.2 + b.2))
                .uid("per-window")
                .collect();
        }
    }
    job
}

/// The `_metadata` files under `dir`, each with its checkpoint directory.
fn metadata_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_owned()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).expect("read_dir").flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.file_name().is_some_and(|n| n == "_metadata") {
                out.push(p);
            }
        }
    }
    // By checkpoint id (`chk-<n>`), not by path text, where chk-9 would follow chk-10.
    let id = |p: &PathBuf| {
        p.parent()
            .and_then(|d| d.file_name())
            .and_then(|n| n.to_str())
            .and_then(|n| n.strip_prefix("chk-"))
            .and_then(|n| n.parse::<u64>().ok())
    };
    out.sort_by_key(|p| (id(p), p.clone()));
    out
}

/// A deterministic random sequence: `splitmix64(seed, i)` for i = 0, 1, ...
struct Rng {
    seed: u64,
    i: u64,
}

impl Rng {
    fn next(&mut self) -> u64 {
        self.i += 1;
        splitmix64(self.seed, self.i)
    }
}

/// The runtime's section of the job facts, and the offsets of its fields (an rkyv
/// `JobSnapshot`: `shards` u32, `max_parallelism` u16, padding, `format_version` u32).
const JOB_SECTION: &str = "weir/job";
const SHARDS_AT: usize = 0;
const MAX_PARALLELISM_AT: usize = 4;
const FORMAT_VERSION_AT: usize = 8;

/// A job's newest checkpoint, taken on 2 shards, and what a test needs to forge it.
struct Checkpointed {
    shape: Shape,
    dir: tempfile::TempDir,
    records: Vec<(u64, i64, u64)>,
    /// Its `_metadata` and checkpoint directory.
    meta_path: PathBuf,
    chk: PathBuf,
    pristine: Vec<u8>,
    meta: CheckpointMetadata,
}

/// Runs a job of `shape` on 2 shards until 3 checkpoints completed, then cancels it.
fn checkpointed(shape: Shape) -> Checkpointed {
    let dir = tempfile::tempdir().expect("tmp");
    let records = data(20_000);
    let ck = CheckpointConfig::new(dir.path(), "forged")
        .with_interval(Duration::from_millis(10))
        .with_mode(CheckpointMode::ExactlyOnce)
        .with_unaligned(matches!(shape, Shape::Windows))
        .with_retained(1)
        .with_restart(RestartStrategy::None);
    let config = JobConfig::new()
        .with_shards(2)
        .with_pinning(Pinning::Never)
        .with_checkpointing(ck);
    // Half of the input held (10 s): it is small, and 3 checkpoints took up to 4 s with five
    // test binaries at a time on 2 loaded cores.
    let n = records.len() as u64;
    let hold = Hold::new(n, n / 2);
    let h = job(shape, config, &records, Some(hold.clone()))
        .start()
        .expect("start");
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while h.checkpoint_metrics().number_of_completed_checkpoints < 3 {
        // Held, the job ends only when it fails: say why at once.
        if h.is_finished() && h.checkpoint_metrics().number_of_completed_checkpoints < 3 {
            panic!("the job ended before 3 checkpoints: {:?}", h.wait().err());
        }
        assert!(std::time::Instant::now() < deadline, "no checkpoints");
        std::thread::sleep(Duration::from_millis(2));
    }
    h.cancel();
    hold.release();
    assert!(matches!(h.wait(), Err(JobError::Cancelled)));
    let files = metadata_files(dir.path());
    let meta_path = files.last().expect("a checkpoint").clone();
    let chk = meta_path.parent().expect("checkpoint dir").to_owned();
    let pristine = std::fs::read(&meta_path).expect("read");
    let meta = CheckpointMetadata::decode(&meta_path, &pristine).expect("decodes");
    Checkpointed {
        shape,
        dir,
        records,
        meta_path,
        chk,
        pristine,
        meta,
    }
}

impl Checkpointed {
    /// Starts the job on `shards` shards from the checkpoint: by its path, or as the newest
    /// of the job's checkpoint directory (`latest`).
    fn start(&self, shards: usize, latest: bool) -> Result<JobHandle, StartError> {
        // Checkpoints of a job restored by path go elsewhere, and a failure is final.
        let (ck, from) = if latest {
            (
                CheckpointConfig::new(self.dir.path(), "forged"),
                RestoreFrom::Latest,
            )
        } else {
            (
                CheckpointConfig::new(self.dir.path().join("restored"), "forged"),
                RestoreFrom::Path(self.chk.clone()),
            )
        };
        let config = JobConfig::new()
            .with_shards(shards)
            .with_pinning(Pinning::Never)
            .with_checkpointing(ck.with_retained(1).with_restart(RestartStrategy::None))
            .with_restore(from);
        job(self.shape, config, &self.records, None).start()
    }

    /// Restores the job on `shards` shards from the checkpoint and runs it to the end.
    fn restore(&self, shards: usize) -> Result<(), String> {
        match self.start(shards, false) {
            Err(e) => Err(format!("start: {e}")),
            Ok(h) => h.wait().map(|_| ()).map_err(|e| match e {
                JobError::Panic { .. } => panic!("a forged checkpoint made a shard panic: {e}"),
                e => format!("run: {e}"),
            }),
        }
    }

    /// Writes `m` as the checkpoint's `_metadata`, CRC and all.
    fn forge(&self, m: &CheckpointMetadata) {
        std::fs::write(&self.meta_path, m.encode()).expect("write");
    }
}

/// Checkpoints a job of `shape`, then restores it from `cases()` forgeries of the newest
/// checkpoint's runtime sections (seeded by `seed`).
fn forge_and_restore(shape: Shape, seed: u64) {
    let c = checkpointed(shape);
    let meta = &c.meta;
    assert!(meta.sections.len() >= 3, "job and shard sections");
    assert!(
        !meta.files.is_empty() || !meta.logical_files.is_empty(),
        "files to forge references to"
    );
    // The harness restores: the checkpoint as it was runs to the end.
    c.restore(2).expect("the pristine checkpoint restores");

    let mut rng = Rng { seed, i: 0 };
    let (mut refused, mut ran) = (0, 0);
    // Refusals of forged section bytes alone: file-reference forgeries are refused by the
    // verification before any section is read, so they would pass the check below alone.
    let mut sections_refused = 0;
    for case in 0..cases() {
        let mut m = meta.clone();
        // A third of the cases change what the metadata says of a file it references (its
        // size, CRC, offset or first block), the others the bytes of a section.
        let mut near = |x: u64, max: u64| match rng.next() % 4 {
            0 => x.wrapping_add(1) & max,
            1 => x.wrapping_sub(1) & max,
            2 => max,
            _ => rng.next() & max,
        };
        let files = m.files.len() + m.logical_files.len();
        let forges_a_file = case % 3 == 0 && files > 0;
        // The job section's index, if it is the one forged.
        let mut forged_job = None;
        if forges_a_file {
            let i = (case as usize / 3) % files;
            let field = (case / 3 / files as u64) % 4;
            if let Some(f) = m.files.get_mut(i) {
                match field {
                    0 | 2 => f.size_bytes = near(f.size_bytes, u64::MAX),
                    _ => f.crc32 = near(u64::from(f.crc32), u64::from(u32::MAX)) as u32,
                }
            } else if let Some(l) = m.logical_files.get_mut(i - m.files.len()) {
                match field {
                    0 => l.size_bytes = near(l.size_bytes, u64::MAX),
                    1 => l.offset = near(l.offset, u64::MAX),
                    2 => l.first_block = near(u64::from(l.first_block), u64::from(u32::MAX)) as u32,
                    _ => l.crc32 = near(u64::from(l.crc32), u64::from(u32::MAX)) as u32,
                }
            }
        } else {
            let s = (rng.next() % m.sections.len() as u64) as usize;
            forged_job = (m.sections[s].0 == JOB_SECTION).then_some(s);
            let bytes = &mut m.sections[s].1;
            let changes = 1 + rng.next() % 3;
            for _ in 0..changes {
                if bytes.is_empty() {
                    break;
                }
                let at = (rng.next() % bytes.len() as u64) as usize;
                bytes[at] = match rng.next() % 4 {
                    0 => rng.next() as u8,
                    1 => bytes[at].wrapping_add(1),
                    2 => bytes[at].wrapping_sub(1),
                    _ => 0xff,
                };
            }
        }
        // A changed shard count, max parallelism or format version (not the padding between
        // the second and third) must be refused, whatever the new value.
        let forged_job_field = forged_job.is_some_and(|j| {
            let (now, was) = (&m.sections[j].1, &meta.sections[j].1);
            (SHARDS_AT..MAX_PARALLELISM_AT + 2)
                .chain(FORMAT_VERSION_AT..FORMAT_VERSION_AT + 4)
                .any(|i| now[i] != was[i])
        });
        c.forge(&m);
        let shards = 1 + (case % 3) as usize;
        match c.restore(shards) {
            Err(e) => {
                assert!(!e.contains("panicked"), "case {case}: {e}");
                refused += 1;
                if !forges_a_file {
                    sections_refused += 1;
                }
            }
            Ok(()) => {
                assert!(!forged_job_field, "case {case}: a changed job field ran");
                ran += 1
            }
        }
    }
    std::fs::write(&c.meta_path, &c.pristine).expect("write");
    eprintln!(
        "{shape:?}: forged checkpoints: {refused} refused ({sections_refused} of forged \
         sections), {ran} ran"
    );
    assert!(
        sections_refused > 0,
        "no forged section was refused: the changes missed the sections"
    );
}

#[test]
fn a_restore_from_forged_keyed_state_sections_fails_without_a_panic_or_runs() {
    forge_and_restore(Shape::Sum, 0x5eed);
}

#[test]
fn a_restore_from_forged_window_timer_and_in_flight_sections_fails_without_a_panic_or_runs() {
    forge_and_restore(Shape::Windows, 0xf00d);
}

/// The sections' consistency, case by case, on a checkpoint of 2 shards: each forgery is
/// refused at start with an error naming the checkpoint, `_metadata`, the section and the
/// field (or, for a file the metadata does not list, the file). A `shards` lowered to 1
/// (CRCs written again) ran to the end with shard 1's keyed state dropped and wrong sums; 0
/// and a format version this build never wrote passed too.
#[test]
fn a_restore_from_a_forged_shard_count_shard_section_set_or_format_version_is_refused() {
    let c = checkpointed(Shape::Sum);
    let id = c.meta.checkpoint_id;
    let job_at = |m: &CheckpointMetadata| {
        m.sections
            .iter()
            .position(|(n, _)| n == JOB_SECTION)
            .expect("a job section")
    };
    let section = |m: &CheckpointMetadata, name: &str| {
        m.sections
            .iter()
            .find(|(n, _)| n == name)
            .unwrap_or_else(|| panic!("section {name}"))
            .1
            .clone()
    };
    let field = |at: usize, value: u32| {
        move |m: &mut CheckpointMetadata| {
            let j = job_at(m);
            m.sections[j].1[at..at + 4].copy_from_slice(&value.to_le_bytes());
        }
    };
    // The offsets are those of the fields this checkpoint holds.
    let job = section(&c.meta, JOB_SECTION);
    assert_eq!(job[SHARDS_AT..SHARDS_AT + 4], 2u32.to_le_bytes(), "{job:?}");
    assert_eq!(
        job[FORMAT_VERSION_AT..FORMAT_VERSION_AT + 4],
        1u32.to_le_bytes()
    );
    let shard1 = section(&c.meta, "weir/shard-0001");

    type Forgery = Box<dyn Fn(&mut CheckpointMetadata)>;
    let cases: Vec<(&str, Forgery, String)> = vec![
        (
            "shards 1",
            Box::new(field(SHARDS_AT, 1)),
            "weir/shard-0001: not a shard of the checkpoint: field shards of section weir/job \
             is 1"
                .into(),
        ),
        (
            "shards 0",
            Box::new(field(SHARDS_AT, 0)),
            "weir/job: field shards is 0".into(),
        ),
        (
            "an extra shard section",
            Box::new(move |m| m.sections.push(("weir/shard-0002".into(), shard1.clone()))),
            "weir/shard-0002: not a shard of the checkpoint: field shards of section weir/job \
             is 2"
                .into(),
        ),
        (
            "a missing shard section",
            Box::new(|m| m.sections.retain(|(n, _)| n != "weir/shard-0001")),
            "weir/shard-0001: missing: field shards of section weir/job is 2".into(),
        ),
        (
            "format version 99",
            Box::new(field(FORMAT_VERSION_AT, 99)),
            "weir/job: field format_version is 99; this build reads version 1".into(),
        ),
        (
            "shard sections swapped",
            Box::new(|m| {
                for (n, _) in m.sections.iter_mut() {
                    if n == "weir/shard-0000" {
                        *n = "weir/shard-0001".into();
                    } else if n == "weir/shard-0001" {
                        *n = "weir/shard-0000".into();
                    }
                }
            }),
            "weir/shard-0000: field shard is 1; the section is shard 0's".into(),
        ),
    ];
    for (what, forge, want) in &cases {
        let mut m = c.meta.clone();
        forge(&mut m);
        c.forge(&m);
        let want = format!("checkpoint {id}: _metadata section {want}");
        match c.start(2, false) {
            Err(StartError::Restore { reason }) => {
                assert!(reason.contains(&want), "{what}: {reason}\nwanted: {want}");
            }
            Err(e) => panic!("{what}: not a restore error: {e}"),
            Ok(h) => panic!("{what}: the job started: {:?}", h.wait()),
        }
    }
    // `latest` reads the job's checkpoint directory the same way (the audit's repro). An
    // older checkpoint that retention had not removed yet when the job was cancelled would
    // be fallen back to: only the forged one stays.
    for p in metadata_files(c.dir.path()) {
        if p != c.meta_path {
            std::fs::remove_dir_all(p.parent().expect("checkpoint dir")).expect("remove");
        }
    }
    let (_, forge, want) = &cases[0];
    let mut m = c.meta.clone();
    forge(&mut m);
    c.forge(&m);
    match c.start(2, true) {
        Err(StartError::Restore { reason }) => {
            let want = format!("checkpoint {id}: _metadata section {want}");
            assert!(reason.contains(&want), "{reason}\nwanted: {want}");
        }
        Err(e) => panic!("latest: not a restore error: {e}"),
        Ok(h) => panic!("latest: the job started: {:?}", h.wait()),
    }
    // Every file a part references must be one the metadata lists: verification reads the
    // listed files and retention keeps them. A segment taken off the list (the CRC written
    // again) passed `verify` unread and could be deleted under the checkpoint.
    let parts = weir_runtime::checkpoint::layout(&c.meta)
        .expect("layout")
        .parts;
    let (shard, path) = parts
        .iter()
        .find_map(|p| Some((p.shard, p.files.first()?.0.clone())))
        .expect("a keyed part with a segment");
    let mut m = c.meta.clone();
    m.files.retain(|f| f.path != Path::new(&path));
    assert_eq!(m.files.len() + 1, c.meta.files.len(), "{path} listed once");
    c.forge(&m);
    match c.start(2, false) {
        Err(StartError::Restore { reason }) => {
            let want = format!(
                "checkpoint {id}: _metadata section weir/shard-{shard:04}: part sum (keyed) \
                 references file {path}"
            );
            assert!(reason.contains(&want), "{reason}\nwanted: {want}");
        }
        Err(e) => panic!("unlisted file: not a restore error: {e}"),
        Ok(h) => panic!("unlisted file: the job started: {:?}", h.wait()),
    }
    std::fs::write(&c.meta_path, &c.pristine).expect("write");
    c.restore(2).expect("the pristine checkpoint restores");
}
