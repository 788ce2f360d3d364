//! The built-in file jobs of `weir run`.

use std::fmt::Write as _;
use std::path::Path;

use weir_runtime::source::{ErrorPolicy, FileFormat, FileSource};
use weir_runtime::{Job, JobConfig, WatermarkStrategy, WindowAssigner};

use crate::{Format, InputArgs, KeyedSumArgs, Policy, WindowCountArgs};

fn config(input: &InputArgs) -> Result<JobConfig, String> {
    // Checked here, before the job starts: inside the job a missing input is an I/O error,
    // which a checkpointing job's restart strategy retries (the file may come back) rather
    // than the one clear line this mistake deserves.
    std::fs::metadata(&input.input).map_err(|e| format!("{}: {e}", input.input.display()))?;
    // Before the overlap checks: an --output that is the input file is named for what it is.
    if input.output.exists() && !input.output.is_dir() {
        return Err(format!(
            "--output {}: exists and is not a directory",
            input.output.display()
        ));
    }
    check_paths(input)?;
    let mut c = JobConfig::new();
    if let Some(n) = input.shards {
        c = c.with_shards(n);
    }
    let from_path = input
        .checkpoint
        .restore
        .as_deref()
        .is_some_and(|r| r != "latest");
    if from_path && input.checkpoint.checkpoint_dir.is_none() {
        // A checkpoint's output is published by the exactly-once sink, which only a
        // checkpointing job has: a plain sink would leave what it had prepared unpublished.
        return Err(
            "--restore needs --checkpoint-dir here: the restored job's --output goes through \
             the exactly-once sink, which publishes what the checkpoint had prepared"
                .into(),
        );
    }
    crate::apply_checkpointing(c, &input.checkpoint)
}

/// Refuses `path` (given as `flag`) inside the job's checkpoint directory `DIR/<job-id>`, or
/// that directory itself: retention and `weir checkpoints clean` delete checkpoint directories
/// there with everything in them. Found with `--output DIR/keyed-sum/chk-1`: the committed
/// output went with checkpoint 1 when checkpoint 2 completed.
pub(crate) fn check_outside_job_dir(
    flag: &str,
    path: &Path,
    a: &crate::CheckpointArgs,
) -> Result<(), String> {
    let (Some(dir), Some(job)) = (&a.checkpoint_dir, &a.job_id) else {
        return Ok(());
    };
    let job_dir = dir.join(job);
    if weir_io::resolved_path(path).starts_with(weir_io::resolved_path(&job_dir)) {
        // `--on-error dead-letter=PATH` is written as one word.
        let sep = if flag.ends_with('=') { "" } else { " " };
        return Err(format!(
            "{flag}{sep}{} is in the job's checkpoint directory {}, where retention \
             deletes checkpoints with what is in them; put it elsewhere",
            path.display(),
            job_dir.display()
        ));
    }
    Ok(())
}

/// Refuses input, output and dead-letter paths that overlap. The job deletes (plain sink) or
/// renames over (exactly-once sink) `part-*` files in --output, so an input there was lost
/// (truncated, the run "succeeding" with 0 records); an --input directory that is --output
/// reads the output as input on the next run; a dead-letter file that is the input was
/// appended to it, and one in --output was overwritten by a part file.
fn check_paths(input: &InputArgs) -> Result<(), String> {
    let (i, o) = (
        weir_io::resolved_path(&input.input),
        weir_io::resolved_path(&input.output),
    );
    let (i_shown, o_shown) = (input.input.display(), input.output.display());
    if i == o {
        return Err(format!(
            "--input {i_shown} is --output {o_shown}: the job would read its own part files as \
             input; write the output to another directory"
        ));
    }
    if i.starts_with(&o) {
        return Err(format!(
            "--input {i_shown} is inside --output {o_shown}, whose part files the job deletes \
             or replaces; write the output to another directory"
        ));
    }
    // The other way round too: output written into the input directory becomes input of the
    // next run (today only files directly in it are read, but a run over `--input` must not
    // depend on that to leave its input alone).
    if o.starts_with(&i) {
        return Err(format!(
            "--output {o_shown} is inside --input {i_shown}: the job would write into its own \
             input; write the output to another directory"
        ));
    }
    // A file of an input directory may be a link into --output: its part file, truncated or
    // deleted before the job reads it (the run "succeeded" with 0 records in).
    if i.is_dir() {
        let entries = std::fs::read_dir(&input.input).map_err(|e| format!("{i_shown}: {e}"))?;
        for e in entries.flatten() {
            let target = weir_io::resolved_path(&e.path());
            if target.starts_with(&o) {
                return Err(format!(
                    "--input {i_shown}: {} is {}, inside --output {o_shown}, whose part files \
                     the job deletes or replaces; write the output to another directory",
                    e.path().display(),
                    target.display()
                ));
            }
        }
    }
    check_outside_job_dir("--input", &input.input, &input.checkpoint)?;
    check_outside_job_dir("--output", &input.output, &input.checkpoint)?;
    if let Policy::DeadLetter(d) = &input.on_error {
        check_outside_job_dir("--on-error dead-letter=", d, &input.checkpoint)?;
        let d_shown = d.display();
        let dr = weir_io::resolved_path(d);
        if dr.starts_with(&i) {
            return Err(format!(
                "--on-error dead-letter={d_shown} is --input {i_shown} or inside it: dead \
                 letters would be written into the input"
            ));
        }
        if dr.starts_with(&o) {
            return Err(format!(
                "--on-error dead-letter={d_shown} is inside --output {o_shown}, which holds the \
                 job's part files; write dead letters elsewhere"
            ));
        }
        if dr.is_dir() {
            return Err(format!(
                "--on-error dead-letter={d_shown}: is a directory, not a file"
            ));
        }
    }
    Ok(())
}

/// Ends a stream of output lines: exactly once through the two-phase-commit file sink when the
/// job checkpoints, else a plain file sink. A job that starts from the beginning replaces the
/// part files of earlier runs in --output, checkpointing or not (kept, they were counted
/// twice: a second run of the same input left two copies of every line): the exactly-once
/// sink removes them at its first commit; the plain sink writes into a hidden staging
/// directory, whose files replace them once the job has finished ([`Output::publish`]), so
/// that a run that fails (as it sets up, or at a malformed line) leaves the earlier output as
/// it was, as a failed Flink batch job commits nothing. A job that restores keeps them, and
/// its sink publishes or discards what its checkpoint had pending.
///
/// Either way under the output directory's lock, so that a job never touches a directory
/// another job writes: the plain sink's run deleted a running checkpointed job's published
/// files. The plain sink takes no lock of its own, so the returned [`Output`] holds it until
/// the job ends; the exactly-once sink is handed the lock the cleanup took (it takes one
/// itself when the job restores).
fn write_output<T: weir_runtime::Data>(
    stream: weir_runtime::Stream<T>,
    input: &InputArgs,
    default_job_id: &str,
    format: impl Fn(&T, &mut String) + Send + Sync + 'static,
) -> Result<Output, String> {
    let fresh = starts_from_the_beginning(input, default_job_id)?;
    let lock = if fresh || input.checkpoint.checkpoint_dir.is_none() {
        Some(lock_output(&input.output)?)
    } else {
        None
    };
    if input.checkpoint.checkpoint_dir.is_some() {
        let mut sink = weir_runtime::sink::TransactionalFileSink::new(input.output.clone(), format);
        if fresh {
            // Removed at the first commit, once the job runs: a run that fails as it sets up
            // leaves the earlier output as it was.
            sink = sink.replacing(part_files(&input.output)?);
        }
        if let Some(lock) = lock {
            // Held on: released between the cleanup and the sink, another job could take the
            // directory (a restore there found the output the cleanup had just removed).
            sink = sink.with_lock(lock);
        }
        // A stable uid: a restore hands the checkpoint's transactions to the sink of that uid.
        stream.sink(sink).uid("output");
        return Ok(Output {
            staged: None,
            _lock: None,
        });
    }
    let staged = Staged::new(&input.output)?;
    stream
        .write_lines(staged.staging.clone(), format)
        .uid("output");
    Ok(Output {
        staged: Some(staged),
        _lock: lock,
    })
}

/// The name of a plain run's staging directory in `--output`: hidden, as the exactly-once
/// sink's files in progress are; one at a time, under the output directory's lock.
const STAGING_DIR: &str = ".weir-staging";

/// What a run's output needs when the job ends. Dropped without [`Output::publish`] (the job
/// failed), a plain run's staged files go and the earlier output stays.
#[must_use = "the output directory's lock: hold it while the job runs, then publish"]
struct Output {
    // Before the lock: fields drop in order, so the staging directory goes while it is held.
    staged: Option<Staged>,
    _lock: Option<weir_io::DirLock>,
}

impl Output {
    /// After the job finished: a plain run's part files replace the earlier runs' (the
    /// exactly-once sink has published its own at its last commit).
    fn publish(mut self) -> Result<(), String> {
        match self.staged.as_mut() {
            Some(s) => s.publish(),
            None => Ok(()),
        }
    }
}

/// A plain run's part files, written into `output/.weir-staging` until the job finishes.
struct Staged {
    output: std::path::PathBuf,
    staging: std::path::PathBuf,
    published: bool,
}

impl Staged {
    /// Clears what a killed run left in the staging directory (the caller holds the output
    /// directory's lock, so no running job owns it). A link there is removed, not followed.
    fn new(output: &Path) -> Result<Staged, String> {
        let staging = output.join(STAGING_DIR);
        let shown = |e: std::io::Error| format!("{}: {e}", staging.display());
        match std::fs::symlink_metadata(&staging) {
            Ok(m) if m.is_dir() => std::fs::remove_dir_all(&staging).map_err(shown)?,
            Ok(_) => std::fs::remove_file(&staging).map_err(shown)?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(shown(e)),
        }
        Ok(Staged {
            output: output.to_path_buf(),
            staging,
            published: false,
        })
    }

    /// Renames each staged part file over its namesake (a link of that name is replaced,
    /// not written through), removes the earlier runs' other part files, then makes the
    /// directory durable. A crash in between leaves a mix of both runs' files, never a
    /// partial file.
    fn publish(&mut self) -> Result<(), String> {
        let shown = |p: &Path, e: std::io::Error| format!("{}: {e}", p.display());
        let earlier = part_files(&self.output)?;
        let mut new = Vec::new();
        // A job whose shards wrote nothing may not have created the directory.
        if self.staging.is_dir() {
            for e in std::fs::read_dir(&self.staging).map_err(|e| shown(&self.staging, e))? {
                let e = e.map_err(|e| shown(&self.staging, e))?;
                let to = self.output.join(e.file_name());
                std::fs::rename(e.path(), &to).map_err(|err| shown(&to, err))?;
                new.push(to);
            }
        }
        for f in earlier.iter().filter(|f| !new.contains(f)) {
            std::fs::remove_file(f).map_err(|e| shown(f, e))?;
        }
        std::fs::File::open(&self.output)
            .and_then(|d| d.sync_all())
            .map_err(|e| shown(&self.output, e))?;
        self.published = true;
        match std::fs::remove_dir(&self.staging) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(shown(&self.staging, e)),
            _ => Ok(()),
        }
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        if !self.published {
            // Best effort: what is left is hidden, and the next run clears it.
            let _ = std::fs::remove_dir_all(&self.staging);
        }
    }
}

/// Whether the job will start from the beginning rather than restore: no `--restore`, or
/// `--restore latest` over a job directory where the runtime finds nothing to restore (it
/// then starts from the beginning and says so). Where that is not certain (a listing that
/// fails, say), false: earlier output is then kept, as before.
///
/// A run without `--restore` whose job directory holds checkpoints of an earlier run is
/// refused: it would replace that run's output, and if it were killed before its own first
/// checkpoint, `--restore latest` would take the earlier run's newest checkpoint, whose
/// output is gone (the restore failed for good, or, from a finished run's last checkpoint,
/// restored nothing and exited 0 with the output empty).
fn starts_from_the_beginning(input: &InputArgs, default_job_id: &str) -> Result<bool, String> {
    let ck = &input.checkpoint;
    let Some(dir) = &ck.checkpoint_dir else {
        return Ok(ck.restore.is_none());
    };
    let job = ck.job_id.as_deref().unwrap_or(default_job_id);
    let resume = ck.restore.as_deref() == Some("latest");
    match (ck.restore.as_deref(), earlier_checkpoints(dir, job, resume)) {
        (None, Earlier::Run(newest)) => Err(format!(
            "{} holds checkpoints of an earlier run ({newest}): continue it with --restore \
             latest, or start over after removing that directory (or with another --job-id)",
            dir.join(job).display()
        )),
        (None, _) => Ok(true),
        (Some("latest"), Earlier::Nothing) => Ok(true),
        (Some(_), _) => Ok(false),
    }
}

/// What a job directory holds that a `--restore latest` would restore or stop at.
enum Earlier {
    /// Nothing: no such directory, or none of the below in it.
    Nothing,
    /// Its newest checkpoint that completed or whose metadata exists (damaged), or the
    /// record of one that completed: described.
    Run(String),
    /// The directory could not be read.
    Unknown,
}

/// With `resume`, only what `--restore latest` would take (see the runtime's restore): the
/// checkpoints of the directory's newest run, else what that run restored, as its
/// `RUN_ORIGIN` records.
fn earlier_checkpoints(dir: &Path, job: &str, resume: bool) -> Earlier {
    if !dir.join(job).exists() {
        return Earlier::Nothing;
    }
    let Some(s) = open_storage(dir, job) else {
        return Earlier::Unknown;
    };
    let Ok(listed) = s.list() else {
        return Earlier::Unknown;
    };
    let origin = match resume.then(|| s.run_origin()).transpose() {
        Ok(o) => o.flatten(),
        Err(_) => return Earlier::Unknown,
    };
    let min_id = origin.as_ref().map_or(0, |o| o.first_id);
    let newest = listed
        .into_iter()
        .filter(|i| (i.complete || i.metadata_corrupt) && i.id >= min_id)
        .map(|i| i.id)
        .max();
    if let (None, Some((_, restored))) = (newest, origin.and_then(|o| o.restored)) {
        return Earlier::Run(format!(
            "{}, which the last run restored",
            restored.display()
        ));
    }
    match (newest, s.completed_record()) {
        (Some(id), _) => Earlier::Run(format!("checkpoint {id}")),
        (None, Ok(None)) => Earlier::Nothing,
        // Records older than the last run, or damaged ones, are what the runtime's failover
        // passes over too: the run started over from the beginning.
        (None, Ok(Some(n))) if n < min_id => Earlier::Nothing,
        (None, Err(_)) if min_id > 0 => Earlier::Nothing,
        (None, _) => Earlier::Run(format!(
            "a record of a completed one in {}",
            weir_io::COMPLETED_FILE
        )),
    }
}

fn open_storage(dir: &Path, job: &str) -> Option<weir_io::CheckpointStorage> {
    weir_io::CheckpointStorage::open_read_only_with(
        std::sync::Arc::new(weir_io::StdFs),
        dir,
        job,
        weir_runtime::checkpoint::storage_options(),
    )
    .ok()
}

/// The output directory's lock (the one the exactly-once sink takes), created with the
/// directory: one job per output directory.
fn lock_output(dir: &Path) -> Result<weir_io::DirLock, String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    weir_io::DirLock::acquire_named(dir, weir_runtime::sink::SINK_LOCK_FILE).map_err(|e| match e {
        weir_io::IoError::Locked { lock_file, .. } => format!(
            "output directory {}: in use by another job ({} is locked); give each job its own \
             output directory",
            dir.display(),
            lock_file.display()
        ),
        e => format!("output directory {}: {e}", dir.display()),
    })
}

/// The job's checkpoints, for the summary: a line in words, then the job's checkpoint
/// metrics under Flink's names, then the newest completed checkpoint's own figures (Flink's
/// per-checkpoint statistics; durations in milliseconds, the acknowledgements as each
/// shard's time from the trigger).
pub fn checkpoint_summary(c: &weir_runtime::checkpoint::CheckpointMetrics) -> String {
    let mut s = format!(
        "checkpoints: {} completed, {} failed, last {} ms, {} bytes ({} full){}",
        c.number_of_completed_checkpoints,
        c.number_of_failed_checkpoints,
        c.last_checkpoint_duration_ms,
        c.last_checkpoint_size,
        c.last_checkpoint_full_size,
        c.last_checkpoint_restore_timestamp
            .map(|t| format!(", restored at {t}"))
            .unwrap_or_default()
    );
    // Flink reports -1 for a job that never restored.
    let restored = c
        .last_checkpoint_restore_timestamp
        .map_or(-1, |t| i64::try_from(t).unwrap_or(i64::MAX));
    let _ = write!(
        s,
        "\ncheckpoint metrics: numberOfCompletedCheckpoints={} numberOfFailedCheckpoints={} \
         numberOfInProgressCheckpoints={} lastCheckpointDuration={} lastCheckpointSize={} \
         lastCheckpointFullSize={} lastCheckpointRestoreTimestamp={restored}",
        c.number_of_completed_checkpoints,
        c.number_of_failed_checkpoints,
        c.number_of_in_progress_checkpoints,
        c.last_checkpoint_duration_ms,
        c.last_checkpoint_size,
        c.last_checkpoint_full_size,
    );
    if let Some(k) = c.history.iter().rev().find(|k| k.failure.is_none()) {
        let ms = |ns: u64| ns as f64 / 1e6;
        let acks: Vec<String> = k
            .ack_ns
            .iter()
            .enumerate()
            .map(|(shard, &ns)| format!("{shard}:{:.3}", ms(ns)))
            .collect();
        let _ = write!(
            s,
            "\ncheckpoint {}: triggerTimestamp={} duration={:.3} syncDuration={:.3} \
             asyncDuration={:.3} alignmentDuration={:.3} startDelay={:.3} \
             persistedInFlightBytes={} size={} fullSize={} acknowledged={}",
            k.checkpoint_id,
            k.trigger_timestamp_ms,
            ms(k.duration_ns),
            ms(k.sync_duration_ns),
            ms(k.async_duration_ns),
            ms(k.alignment_duration_ns),
            ms(k.start_delay_ns),
            k.persisted_inflight_bytes,
            k.size_bytes,
            k.full_size_bytes,
            acks.join(",")
        );
    }
    s
}

/// The job's checkpoints on a status line: counts and the newest one's duration and size.
pub fn checkpoint_status(c: &weir_runtime::checkpoint::CheckpointMetrics) -> String {
    format!(
        "checkpoints {} ({} ms, {} B) failed {} in progress {}",
        c.number_of_completed_checkpoints,
        c.last_checkpoint_duration_ms,
        c.last_checkpoint_size,
        c.number_of_failed_checkpoints,
        c.number_of_in_progress_checkpoints
    )
}

fn format(f: Format) -> FileFormat {
    match f {
        Format::Csv => FileFormat::Csv,
        Format::Jsonl => FileFormat::JsonLines,
    }
}

/// The name of the dead-letter start record in the job's checkpoint directory.
pub const DEAD_LETTER_START: &str = "dead-letter-start";

/// With a checkpoint directory and dead letters, the source keeps the dead-letter file's
/// length at the start of a run in `CHECKPOINT_DIR/JOB/dead-letter-start`, and `--restore
/// latest` takes it as the start: a restart from the beginning after a run killed before its
/// first checkpoint then cuts that run's dead letters away instead of writing them twice.
fn with_start_record<T: Send + 'static>(
    source: FileSource<T>,
    input: &InputArgs,
    default_job_id: &str,
) -> FileSource<T> {
    let (Some(dir), Policy::DeadLetter(_)) = (&input.checkpoint.checkpoint_dir, &input.on_error)
    else {
        return source;
    };
    let job = input.checkpoint.job_id.as_deref().unwrap_or(default_job_id);
    let resume = input.checkpoint.restore.as_deref() == Some("latest");
    source.dead_letter_start_record(dir.join(job).join(DEAD_LETTER_START), resume)
}

fn policy(p: &Policy) -> ErrorPolicy {
    match p {
        Policy::Fail => ErrorPolicy::Fail,
        Policy::Skip => ErrorPolicy::Skip,
        Policy::DeadLetter(p) => ErrorPolicy::DeadLetter(p.clone()),
    }
}

/// The part files of earlier runs in `dir`, visible (`part-*.csv`) and hidden (the
/// exactly-once sink's `.part-*` in-progress and pending files): what a run from the
/// beginning replaces, so that the directory holds only its output. A symbolic link among
/// them is listed itself (removing it leaves its target alone; left in place, the plain sink
/// would write through it into the file it names); directories are not.
fn part_files(dir: &Path) -> Result<Vec<std::path::PathBuf>, String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let entries = std::fs::read_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let mut out = Vec::new();
    for e in entries.flatten() {
        let name = e.file_name();
        let name = name.to_string_lossy();
        let part =
            (name.starts_with("part-") && name.ends_with(".csv")) || name.starts_with(".part-");
        if part && e.file_type().is_ok_and(|t| !t.is_dir()) {
            out.push(e.path());
        }
    }
    Ok(out)
}

fn parse_int(field: &str, column: &str) -> Result<i64, String> {
    let t = field.trim();
    t.parse::<i64>().map_err(|_| {
        if t.parse::<i128>().is_ok() {
            format!("column `{column}`: `{field}` is outside the 64-bit integer range")
        } else {
            format!("column `{column}`: `{field}` is not an integer")
        }
    })
}

/// A timestamp is bad input, named with its line under the error policy, when it is
/// `i64::MIN` (the engine's mark of a record without a timestamp) or its `window_ms` window
/// does not fit in the 64-bit millisecond range: inside the job either one fails it without
/// naming the line.
fn check_window(ts: i64, window_ms: i64, column: &str, field: &str) -> Result<(), String> {
    let fits = ts != i64::MIN
        && weir_runtime::window_start(ts, 0, window_ms)
            .is_some_and(|start| start.checked_add(window_ms).is_some());
    if fits {
        Ok(())
    } else {
        Err(format!(
            "column `{column}`: `{field}` has no {window_ms} ms window within the 64-bit \
             millisecond range"
        ))
    }
}

/// A key longer than keyed state takes is a bad line under the error policy: in the job it
/// fails the keyed operator without naming the line.
fn check_key(field: &str, column: &str) -> Result<(), String> {
    use weir_state::KeyCodec;
    let len = field.encoded_len();
    if len > weir_state::MAX_KEY_BYTES {
        return Err(format!(
            "column `{column}`: a key of {len} bytes (encoded) is longer than the {} bytes \
             keyed state takes",
            weir_state::MAX_KEY_BYTES
        ));
    }
    Ok(())
}

pub fn keyed_sum(a: &KeyedSumArgs) -> Result<(), String> {
    let value_col = a.value.clone();
    let key_col = a.key.clone();
    let source = FileSource::new(
        a.input.input.clone(),
        format(a.input.format),
        &[a.key.as_str(), a.value.as_str()],
        // Values are 64-bit; sums are 128-bit, so that no sum is clamped or wraps: reaching
        // 2^127 takes more than 2^64 records.
        move |f: &[&str], _| {
            check_key(f[0], &key_col)?;
            Ok((f[0].to_string(), i128::from(parse_int(f[1], &value_col)?)))
        },
    )
    .error_policy(policy(&a.input.on_error));
    let source = with_start_record(source, &a.input, "keyed-sum");
    let skipped = source.skipped();
    let job = Job::new(config(&a.input)?);
    let sums = job
        .source(source)
        .uid("input")
        .key_by(|(k, _): &(String, i128)| k.clone())
        .reduce(|(k, a), (_, b)| (k, a + b))
        .uid("keyed-sum");
    let output = write_output(
        sums,
        &a.input,
        "keyed-sum",
        |(k, s): &(String, i128), line: &mut String| {
            let _ = write!(line, "{},{}", csv_field(k), s);
        },
    )?;
    let summary = crate::stop::run(job, &a.input.checkpoint, "keyed-sum")?;
    output.publish()?;
    eprintln!(
        "keyed-sum: {} records in, {} skipped, {} shards, {:.2}s",
        summary.metrics.records_in("keyed-sum"),
        skipped.load(std::sync::atomic::Ordering::Relaxed),
        summary.shards,
        summary.metrics.elapsed.as_secs_f64()
    );
    if a.input.checkpoint.checkpoint_dir.is_some() {
        eprintln!("{}", checkpoint_summary(&summary.checkpoints));
    }
    Ok(())
}

pub fn window_count(a: &WindowCountArgs) -> Result<(), String> {
    let ts_col = a.timestamp.clone();
    let key_col = a.key.clone();
    let window = a.window;
    let source = FileSource::new(
        a.input.input.clone(),
        format(a.input.format),
        &[a.key.as_str(), a.timestamp.as_str()],
        move |f: &[&str], _| {
            check_key(f[0], &key_col)?;
            let ts = parse_int(f[1], &ts_col)?;
            check_window(ts, window, &ts_col, f[1])?;
            Ok((f[0].to_string(), ts))
        },
    )
    .error_policy(policy(&a.input.on_error));
    let source = with_start_record(source, &a.input, "window-count");
    let skipped = source.skipped();
    let job = Job::new(config(&a.input)?);
    let counts = job
        .source(source)
        .uid("input")
        .assign_timestamps(WatermarkStrategy::bounded_out_of_orderness(
            a.out_of_orderness,
            |r: &(String, i64)| r.1,
        ))
        .key_by(|(k, _): &(String, i64)| k.clone())
        .window(WindowAssigner::tumbling(a.window))
        .count_with(|k, w, n| (w.start, k.clone(), n))
        .uid("window-count");
    let output = write_output(
        counts,
        &a.input,
        "window-count",
        |(start, k, n): &(i64, String, u64), line: &mut String| {
            let _ = write!(line, "{start},{},{n}", csv_field(k));
        },
    )?;
    let summary = crate::stop::run(job, &a.input.checkpoint, "window-count")?;
    output.publish()?;
    let m = &summary.metrics;
    eprintln!(
        "window-count: {} records in, {} late, {} skipped, {} windows out, {:.2}s",
        m.records_in("window-count"),
        m.operators
            .iter()
            .filter(|o| o.operator == "window-count")
            .map(|o| o.records_dropped)
            .sum::<u64>(),
        skipped.load(std::sync::atomic::Ordering::Relaxed),
        m.records_out("window-count"),
        m.elapsed.as_secs_f64()
    );
    if a.input.checkpoint.checkpoint_dir.is_some() {
        eprintln!("{}", checkpoint_summary(&summary.checkpoints));
    }
    Ok(())
}

/// Quotes a CSV field when it needs it (RFC 4180).
pub fn csv_field(s: &str) -> std::borrow::Cow<'_, str> {
    if s.contains([',', '"', '\n', '\r']) {
        std::borrow::Cow::Owned(format!("\"{}\"", s.replace('"', "\"\"")))
    } else {
        std::borrow::Cow::Borrowed(s)
    }
}
