//! `weir checkpoints list|verify|inspect|clean DIR`: the checkpoint directory needs nothing
//! but itself.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use clap::Args;
use weir_io::{
    CheckpointError, CheckpointKind, CheckpointMetadata, CheckpointStorage, FileRef, IoError,
    Savepoint, StdFs, VerifyError,
};

#[derive(Args)]
pub struct ListArgs {
    /// A checkpoint directory (holding job directories) or one job's directory.
    pub dir: PathBuf,
    /// One JSON object per checkpoint instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args)]
pub struct VerifyArgs {
    /// A checkpoint directory (holding job directories), one job's directory, a `chk-<n>`
    /// directory or a savepoint directory.
    pub dir: PathBuf,
    /// Verify only checkpoint N, in every job (default: every complete checkpoint).
    #[arg(long, allow_hyphen_values = true)]
    pub checkpoint: Option<u64>,
}

#[derive(Args)]
pub struct InspectArgs {
    /// A checkpoint directory holding one job, one job's directory, a `chk-<n>` directory or a
    /// savepoint directory.
    pub dir: PathBuf,
    /// Inspect checkpoint N of the job (default: its newest complete checkpoint).
    #[arg(long, allow_hyphen_values = true)]
    pub checkpoint: Option<u64>,
    /// One JSON object instead of text.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args)]
pub struct CleanArgs {
    /// A checkpoint directory (holding job directories) or one job's directory.
    pub dir: PathBuf,
    /// Complete checkpoints to keep per job, newest first.
    #[arg(long, allow_hyphen_values = true, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
    pub keep: u64,
}

#[derive(Args)]
pub struct SavepointArgs {
    /// A checkpoint directory holding one job, or one job's directory.
    pub dir: PathBuf,
    /// The checkpoint to copy (default: the newest complete one).
    #[arg(long, allow_hyphen_values = true)]
    pub checkpoint: Option<u64>,
    /// The directory to create the savepoint in (as `savepoint-<n>-<hex>`).
    #[arg(long)]
    pub to: PathBuf,
}

/// Why verification did not pass.
pub enum VerifyFailed {
    /// A checkpoint is corrupt (exit code 3); the message names checkpoint, file and offset.
    Corrupt(String),
    /// The directory could not be read at all.
    Other(String),
}

fn is_job_dir(p: &Path) -> bool {
    p.join(weir_io::SHARED_DIR).is_dir() && p.join(weir_io::TASKOWNED_DIR).is_dir()
}

/// A savepoint has the same two directories and its metadata beside them (a job directory
/// keeps metadata in its `chk-<n>` directories only).
fn is_savepoint_dir(p: &Path) -> bool {
    is_job_dir(p) && p.join(weir_io::METADATA_FILE).is_file()
}

/// `dir` spelled with a last component. `.` and `..` (and `x/..`) have no file name, so a job
/// directory given so was "not a job directory", and a `chk-<n>` one, taken for a savepoint
/// that is not one, was reported corrupt (exit 3).
fn named(dir: &Path) -> PathBuf {
    if dir.file_name().is_some() {
        return dir.to_path_buf();
    }
    std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf())
}

/// The job directories DIR designates, as (root, job id).
fn jobs(dir: &Path) -> Result<Vec<(PathBuf, String)>, String> {
    let split = |p: &Path| -> Result<(PathBuf, String), String> {
        let p = &named(p);
        let root = p
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_else(|| PathBuf::from("."));
        let job = p
            .file_name()
            .and_then(|n| n.to_str())
            .ok_or_else(|| format!("{}: not a job directory", p.display()))?;
        Ok((root, job.to_string()))
    };
    if is_savepoint_dir(dir) {
        // Taken for a job, `clean` locked it (a LOCK file inside the savepoint) and `list`
        // showed a job without checkpoints.
        return Err(format!(
            "{}: a savepoint, not a job's checkpoint directory (`weir checkpoints verify` and \
             `inspect` take it)",
            dir.display()
        ));
    }
    if is_job_dir(dir) {
        return Ok(vec![split(dir)?]);
    }
    let entries = std::fs::read_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let mut out = Vec::new();
    for e in entries.flatten() {
        let p = e.path();
        // A savepoint made into the checkpoint directory sits beside the jobs: not one.
        if !is_job_dir(&p) || is_savepoint_dir(&p) {
            continue;
        }
        // Nor is a directory whose name no job takes (weir refuses such a job id): passed
        // over, with a note, as other entries that are no job's are. It failed `list`,
        // `verify` and `clean` of the whole directory ("invalid job id", exit 1), so the
        // real jobs beside it went unlisted, unverified and uncleaned.
        let name = e.file_name();
        if !name.to_str().is_some_and(weir_io::is_valid_name) {
            eprintln!(
                "weir: {}: skipped: not a job's directory, as its name is no job id ({})",
                p.display(),
                weir_io::VALID_NAME
            );
            continue;
        }
        out.push(split(&p)?);
    }
    out.sort();
    if out.is_empty() {
        return Err(format!(
            "{}: no checkpoints (no job directory with shared/ and taskowned/)",
            dir.display()
        ));
    }
    Ok(out)
}

fn open(root: &Path, job: &str) -> Result<CheckpointStorage, String> {
    let options = weir_runtime::checkpoint::storage_options();
    CheckpointStorage::open_read_only_with(Arc::new(StdFs), root, job, options)
        .map_err(|e| format!("{}: {e}", root.join(job).display()))
}

pub fn list(a: &ListArgs) -> Result<(), String> {
    let jobs = jobs(&a.dir)?;
    if !a.json {
        println!(
            "{:<20} {:>12} {:<11} {:>14} {:>14} {:>15}",
            "job", "checkpoint", "status", "size_bytes", "new_bytes", "completed_ms"
        );
    }
    for (root, job) in jobs {
        let s = open(&root, &job)?;
        // See `listing`: a running job's retention made a checkpoint that completed look
        // gone.
        let Listing {
            mut infos,
            marker,
            stable,
        } = listing(&s).map_err(|e| e.to_string())?;
        let gone = marker.filter(|&done| stable && !kept_since(&infos, done));
        // A `COMPLETED` that does not decode beside no metadata at all: a checkpoint
        // completed and lost its metadata, which no row can show (the record names none). The
        // listing is what it is; the note says what `verify` reports as corruption (exit 3).
        // Before, `list` printed its header alone and said nothing.
        if marker.is_none() {
            if let Some(e) = settled(|| damaged_record_without_metadata(&s)) {
                eprintln!(
                    "weir: note: {job}: {e}: the record of the newest completed checkpoint \
                     does not decode, and no checkpoint has a {}: one completed and its \
                     metadata was removed since (`weir checkpoints verify` reports it)",
                    weir_io::METADATA_FILE
                );
            }
        }
        // Its whole directory removed, the checkpoint that completed is not listed by storage,
        // yet a restore stops at it as at one whose metadata is gone: shown all the same.
        if let Some(done) = gone.filter(|&done| infos.iter().all(|i| i.id != done)) {
            infos.push(weir_io::CheckpointInfo {
                id: done,
                path: s.job_dir().join(weir_io::checkpoint_dir_name(done)),
                complete: false,
                size_bytes: 0,
                new_bytes: 0,
                trigger_timestamp_ms: 0,
                completion_timestamp_ms: 0,
                problem: Some("no directory".into()),
                metadata_corrupt: false,
            });
        }
        infos.sort_by_key(|i| i.id);
        for mut i in infos {
            let status = if i.complete { "complete" } else { "incomplete" };
            if gone == Some(i.id) {
                // Not merely incomplete: what a restore stops at (see `verify`).
                i.problem = Some(format!(
                    "{}; {} names it: it completed, and its {} was removed since",
                    i.problem.as_deref().unwrap_or("no metadata"),
                    weir_io::COMPLETED_FILE,
                    weir_io::METADATA_FILE
                ));
            }
            if a.json {
                let v = serde_json::json!({
                    "job": job,
                    "checkpoint": i.id,
                    "status": status,
                    "path": i.path.display().to_string(),
                    "size_bytes": i.size_bytes,
                    "new_bytes": i.new_bytes,
                    "trigger_timestamp_ms": i.trigger_timestamp_ms,
                    "completion_timestamp_ms": i.completion_timestamp_ms,
                    "problem": i.problem,
                });
                println!("{v}");
            } else {
                println!(
                    "{:<20} {:>12} {:<11} {:>14} {:>14} {:>15}{}",
                    job,
                    i.id,
                    status,
                    i.size_bytes,
                    i.new_bytes,
                    i.completion_timestamp_ms,
                    i.problem.map(|p| format!("  ({p})")).unwrap_or_default()
                );
            }
        }
    }
    Ok(())
}

/// `verify` of one `chk-<n>` or savepoint directory.
fn verify_one(a: &VerifyArgs) -> Result<(), VerifyFailed> {
    let shown = a.dir.display().to_string();
    if let Some((job, s, id)) = chk_dir(&a.dir)? {
        if a.checkpoint.is_some_and(|n| n != id) {
            return Err(VerifyFailed::Other(format!(
                "{shown} is checkpoint {id}, not {}",
                a.checkpoint.unwrap_or_default()
            )));
        }
        let r = s
            .verify(id)
            .map_err(|e| VerifyFailed::Corrupt(format!("{job}: {e}")))?;
        if let Ok(m) = s.read_metadata(id) {
            check_segments(s.job_dir(), &m, &|f, to| s.copy_file_to(f, to))
                .map_err(|e| e.into_failed(&job))?;
        }
        println!(
            "ok {job} checkpoint {id}: {} files, {} logical files, {} bytes checked",
            r.files, r.logical_files, r.bytes_checked
        );
        return Ok(());
    }
    let sp = Savepoint::open(Arc::new(StdFs), &a.dir)
        .map_err(|e| metadata_failed(&shown, e))?
        .with_raw_diagnose(weir_state::diagnose_segment);
    // As for a `chk-<n>` directory (and `inspect`): a savepoint of another checkpoint than
    // the one asked for is not verified, and not reported as that one.
    let id = sp.metadata().checkpoint_id;
    if let Some(n) = a.checkpoint.filter(|&n| n != id) {
        return Err(VerifyFailed::Other(format!(
            "{shown} is a savepoint of checkpoint {id}, not {n}"
        )));
    }
    let r = sp
        .verify()
        .map_err(|e| VerifyFailed::Corrupt(format!("{shown}: {e}")))?;
    check_segments(sp.dir(), sp.metadata(), &|f, to| sp.copy_file_to(f, to))
        .map_err(|e| e.into_failed(&shown))?;
    println!(
        "ok savepoint {shown} (checkpoint {}): {} files, {} logical files, {} bytes checked",
        r.checkpoint_id, r.files, r.logical_files, r.bytes_checked
    );
    Ok(())
}

/// A `chk-<n>` directory of a job directory, opened through its job: (job, storage, n).
fn chk_dir(dir: &Path) -> Result<Option<(String, CheckpointStorage, u64)>, VerifyFailed> {
    let dir = &named(dir);
    // Only the spelling storage writes: `chk-04` is not checkpoint 4's directory.
    let chk = dir
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(weir_io::parse_checkpoint_dir_name);
    let job_dir = dir.parent().filter(|p| is_job_dir(p));
    let Some(job_dir) = job_dir else {
        return Ok(None);
    };
    let Some(id) = chk else {
        // Inside a job directory a `chk-` name that does not parse is no checkpoint's: read
        // as a savepoint it was reported as a misdirected one, which it is not either.
        let name = dir.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if name.starts_with("chk-") {
            return Err(VerifyFailed::Other(format!(
                "{}: not a checkpoint directory: a checkpoint's is chk-<n>, its id in decimal \
                 with no sign and no leading zero, and `{name}` is not; list the job's \
                 checkpoints with `weir checkpoints list {}`",
                dir.display(),
                job_dir.display()
            )));
        }
        return Ok(None);
    };
    let (root, job) = jobs(job_dir).map_err(VerifyFailed::Other)?.remove(0);
    let s = open(&root, &job).map_err(VerifyFailed::Other)?;
    Ok(Some((job, s, id)))
}

pub fn verify(a: &VerifyArgs) -> Result<(), VerifyFailed> {
    if a.dir.join(weir_io::METADATA_FILE).is_file() {
        return verify_one(a);
    }
    // A `chk-<n>` directory without its metadata: checkpoint n of its job, as `--checkpoint n`
    // on the job directory verifies it (one that completed and lost its metadata is corrupt,
    // exit 3). Taken for a directory of jobs, it was "no checkpoints", exit 1.
    if let Some((job, s, id)) = chk_dir(&a.dir)? {
        if let Some(n) = a.checkpoint.filter(|&n| n != id) {
            return Err(VerifyFailed::Other(format!(
                "{} is checkpoint {id}'s directory, not {n}'s",
                a.dir.display()
            )));
        }
        let one = VerifyArgs {
            dir: a.dir.clone(),
            checkpoint: Some(id),
        };
        let mut corrupt = Corrupt::default();
        verify_listed(&one, &s, &job, &mut corrupt)?;
        if corrupt.count > 0 {
            return Err(VerifyFailed::Corrupt(format!(
                "{}: checkpoint {id} is corrupt (named above)",
                a.dir.display()
            )));
        }
        if let Some(lacking) = corrupt.lacking.pop() {
            return Err(VerifyFailed::Other(lacking));
        }
        return Ok(());
    }
    let jobs = jobs(&a.dir).map_err(VerifyFailed::Other)?;
    let several = jobs.len() > 1;
    let (mut checked, mut removed) = (0, 0);
    // Every corruption is reported, each on its own error line as it is found, and the exit
    // code is 3 if there was any: stopping at the first left the other checkpoints (and
    // jobs) unchecked, so a user could not tell which one to restore.
    let mut corrupt = Corrupt::default();
    for (root, job) in jobs {
        let s = open(&root, &job).map_err(VerifyFailed::Other)?;
        if a.checkpoint.is_none() {
            // Replaced by a rename only, so a running job never shows it torn.
            match s.run_origin() {
                Err(e @ CheckpointError::Format(_)) => {
                    corrupt.found(VerifyFailed::Corrupt(format!(
                        "{job}: {e}: the record of where the last run started does not \
                         decode, so a restore from latest stops (restore a checkpoint or \
                         savepoint by its path, or remove the record to restore the newest \
                         checkpoint)"
                    )))?;
                }
                Err(e) => {
                    return Err(VerifyFailed::Other(format!(
                        "{job}: the record of where the last run started cannot be read: {e}"
                    )))
                }
                Ok(_) => {}
            }
            if let Some(done) = completed_without_metadata(&s, None) {
                corrupt.found(completed_metadata_gone(&s, &job, done))?;
            } else if let Some(e) = settled(|| damaged_record_without_metadata(&s)) {
                corrupt.found(VerifyFailed::Corrupt(damaged_record_message(&job, &e)))?;
            }
        }
        // Every checkpoint listed may be dropped while it is verified: list again, so that a
        // job's newer checkpoint is verified instead (a few rounds; a job keeping up with
        // that is checkpointing faster than a verification takes).
        for _round in 0..VERIFY_ROUNDS {
            let (ok, skipped) = verify_listed(a, &s, &job, &mut corrupt)?;
            checked += ok;
            removed += skipped;
            if ok > 0 || skipped == 0 {
                break;
            }
        }
    }
    // `--checkpoint N` that a job lacks: every job is still checked (it stopped at the first
    // job without N, exit 1, and never verified the others' N). One job: its error alone, as
    // before; several: each on its own error line, and a last one saying how many.
    let lacking = match (several || corrupt.count > 0, corrupt.lacking.len()) {
        (_, 0) => String::new(),
        (false, _) => return Err(VerifyFailed::Other(corrupt.lacking.remove(0))),
        (true, n) => {
            for m in &corrupt.lacking {
                eprintln!("error: {m}");
            }
            format!(
                "; {n} {} checkpoint {} (named above)",
                if n == 1 { "job lacks" } else { "jobs lack" },
                a.checkpoint.unwrap_or_default()
            )
        }
    };
    if corrupt.count > 0 {
        return Err(VerifyFailed::Corrupt(format!(
            "{}: {} corrupt (each named above); {checked} verified{lacking}",
            a.dir.display(),
            match corrupt.count {
                1 => "1 checkpoint is".to_string(),
                n => format!("{n} checkpoints are"),
            }
        )));
    }
    if !lacking.is_empty() {
        return Err(VerifyFailed::Other(format!(
            "{}: not every job has checkpoint {}: {checked} verified{lacking}",
            a.dir.display(),
            a.checkpoint.unwrap_or_default()
        )));
    }
    if checked == 0 && removed > 0 {
        return Err(VerifyFailed::Other(format!(
            "{}: every checkpoint listed ({removed} in {VERIFY_ROUNDS} listings) was removed \
             by its job's retention while it was verified: the job completes checkpoints \
             faster than they verify; keep more of them (--retained) or verify when it stops",
            a.dir.display()
        )));
    }
    if checked == 0 {
        return Err(VerifyFailed::Other(format!(
            "{}: no complete checkpoint to verify (no chk-<n>/{} in its job directories, and \
             no {} of a savepoint)",
            a.dir.display(),
            weir_io::METADATA_FILE,
            weir_io::METADATA_FILE
        )));
    }
    Ok(())
}

/// See [`verify`].
const VERIFY_ROUNDS: usize = 5;

/// How many times `savepoint` copies the newest checkpoint of a job whose retention drops
/// the one it copies. A failed try costs little (the hard links come first, and fail at the
/// first file gone), and beside a job checkpointing every 10 ms on a loaded machine five
/// tries all failed about once in twelve.
const SAVEPOINT_ROUNDS: usize = 20;

/// A job directory's checkpoints, listed between two readings of its `COMPLETED` record.
struct Listing {
    infos: Vec<weir_io::CheckpointInfo>,
    /// The checkpoint the record names (the second reading).
    marker: Option<u64>,
    /// Whether both readings agreed.
    stable: bool,
}

/// How many times [`listing`] lists a job directory whose `COMPLETED` record changes.
const LISTING_TRIES: usize = 50;

/// The job's checkpoints, listed until the `COMPLETED` record reads the same before and
/// after (at most [`LISTING_TRIES`] times). A listing reads the job directory, then each
/// checkpoint's metadata: beside a running job, a checkpoint can complete after the first
/// read and retention drop the one before it before the second, so one listing could lack
/// both, and a checkpoint that completed looked gone (`verify` exited 3, `savepoint` found no
/// complete checkpoint). Retention drops a checkpoint only after a newer one completed, and
/// the record names the newer one before retention runs: with the record unchanged across
/// the listing, the checkpoint it names was in the directory when it was read, and is never
/// the one retention drops.
fn listing(s: &CheckpointStorage) -> Result<Listing, CheckpointError> {
    let mut tries = 0;
    loop {
        tries += 1;
        let before = s.completed_marker();
        let infos = s.list()?;
        let marker = s.completed_marker();
        let stable = before == marker;
        if stable || tries == LISTING_TRIES {
            return Ok(Listing {
                infos,
                marker,
                stable,
            });
        }
    }
}

/// How many times, and how far apart, a damaged `COMPLETED` record must be found with no
/// checkpoint metadata beside it before it is reported: see [`settled`].
const SETTLE_ROUNDS: usize = 3;
const SETTLE_PAUSE: std::time::Duration = std::time::Duration::from_millis(20);

/// What `probe` finds, if it finds it in each of [`SETTLE_ROUNDS`] tries a little apart: for
/// the check [`listing`] cannot bracket (a record that does not decode reads the same
/// whatever completes). What is really there is found every time.
fn settled<T>(mut probe: impl FnMut() -> Option<T>) -> Option<T> {
    let mut found = probe()?;
    for _ in 1..SETTLE_ROUNDS {
        std::thread::sleep(SETTLE_PAUSE);
        found = probe()?;
    }
    Some(found)
}

/// The corrupt checkpoints `verify` found so far, each already reported.
#[derive(Default)]
struct Corrupt {
    count: usize,
    /// (job, checkpoint) of those found by [`verify_listed`], which lists again when a
    /// checkpoint went while it was verified: each is reported once.
    ids: std::collections::BTreeSet<(String, u64)>,
    /// Not corrupt, not verified either: the error of each job that lacks the checkpoint
    /// `--checkpoint` names (or lost it while it was verified), reported by the caller.
    lacking: Vec<String>,
}

impl Corrupt {
    /// Report a corrupt checkpoint (an error line naming it, its file and offset) and go on;
    /// any other failure ends the verification.
    fn found(&mut self, e: VerifyFailed) -> Result<(), VerifyFailed> {
        match e {
            VerifyFailed::Corrupt(msg) => {
                eprintln!("error: {msg}");
                self.count += 1;
                Ok(())
            }
            other => Err(other),
        }
    }
}

/// Verifies the checkpoints of `job` that `a` designates, as listed now: how many verified,
/// and how many were removed while they were verified.
fn verify_listed(
    a: &VerifyArgs,
    s: &CheckpointStorage,
    job: &str,
    corrupt: &mut Corrupt,
) -> Result<(usize, usize), VerifyFailed> {
    let (mut checked, mut skipped) = (0, 0);
    let ids: Vec<u64> = match a.checkpoint {
        Some(n) => vec![n],
        None => {
            let infos = listing(s)
                .map_err(|e| VerifyFailed::Other(e.to_string()))?
                .infos;
            // A checkpoint whose metadata exists but does not decode is corrupt, not
            // merely incomplete: verify reports it.
            infos
                .iter()
                .filter(|i| i.complete || i.metadata_corrupt)
                .map(|i| i.id)
                .collect()
        }
    };
    for id in ids {
        if corrupt.ids.contains(&(job.to_string(), id)) {
            continue;
        }
        // The segments' own checks after the CRCs. If the metadata is gone by then, retention
        // removed the checkpoint meanwhile, and it counts as verified by its CRCs.
        let verified =
            s.verify(id)
                .map_err(SegmentsFailed::Verify)
                .and_then(|r| match s.read_metadata(id) {
                    Ok(m) => {
                        check_segments(s.job_dir(), &m, &|f, to| s.copy_file_to(f, to)).map(|()| r)
                    }
                    Err(_) => Ok(r),
                });
        let verified = match verified {
            Err(e @ (SegmentsFailed::Scratch(_) | SegmentsFailed::Sections(_))) => {
                corrupt.found(e.into_failed(job))?;
                corrupt.ids.insert((job.to_string(), id));
                continue;
            }
            Err(SegmentsFailed::Verify(e)) => Err(e),
            Ok(r) => Ok(r),
        };
        match verified {
            Ok(r) => {
                checked += 1;
                println!(
                    "ok {job} checkpoint {id}: {} files, {} logical files, {} bytes checked",
                    r.files, r.logical_files, r.bytes_checked
                );
            }
            Err(e @ VerifyError::NotFound { .. }) if a.checkpoint.is_some() => {
                match completed_without_metadata(s, Some(id)) {
                    Some(done) => corrupt.found(completed_metadata_gone(s, job, done))?,
                    None => corrupt.lacking.push(format!("{job}: {e}")),
                }
            }
            // A running job's retention may drop a checkpoint while it is verified (its
            // metadata first, then the files only it used): a file gone then is not
            // corruption. Found verifying beside a job checkpointing every 10 ms: "has no
            // metadata" reported as corrupt, exit 3.
            Err(e) if !still_there(s, id) => {
                if a.checkpoint.is_some() {
                    corrupt.lacking.push(format!(
                        "{job}: checkpoint {id} was removed while it was verified ({e})"
                    ));
                    continue;
                }
                eprintln!("weir: {job} checkpoint {id} was removed while it was verified; skipped");
                skipped += 1;
            }
            Err(e) => {
                corrupt.found(VerifyFailed::Corrupt(format!("{job}: {e}")))?;
                corrupt.ids.insert((job.to_string(), id));
            }
        }
    }
    Ok((checked, skipped))
}

/// After the CRCs matched the metadata: the runtime's sections agree with each other (shard
/// count, shard sections, format version) and reference only files the metadata lists
/// (`weir_runtime::checkpoint::layout`), and every
/// segment the checkpoint references passes the checks a restore makes of it (structure, every
/// key in its filter), so that `verify` refuses what a restore would. A CRC only says the bytes are those the metadata describes, and a
/// file changed together with its metadata passes it. A raw segment is checked in place. A
/// framed one (a copy, made where the hard link failed: the state directory on another file
/// system) is first taken out of its frames by `copy_out`, as a restore does, into a scratch
/// file in the system's temporary directory, one at a time; its errors name the framed file
/// and offsets in its content. Files that are not segments are left to the CRC.
fn check_segments(
    base: &Path,
    m: &CheckpointMetadata,
    copy_out: &dyn Fn(&FileRef, &Path) -> Result<u64, CheckpointError>,
) -> Result<(), SegmentsFailed> {
    let checkpoint_id = m.checkpoint_id;
    // A forged shard count or file reference passes every CRC (the metadata's is written
    // again with it).
    weir_runtime::checkpoint::layout(m)
        .map_err(|e| SegmentsFailed::Sections(format!("checkpoint {checkpoint_id}: {e}")))?;
    let corrupt = |source| {
        SegmentsFailed::Verify(VerifyError::Corrupt {
            checkpoint_id,
            source,
        })
    };
    let unread = |source| {
        SegmentsFailed::Verify(VerifyError::Io {
            checkpoint_id,
            source,
        })
    };
    let mut scratch: Option<tempfile::TempDir> = None;
    for f in &m.files {
        if f.is_raw() {
            if let Some(e) = weir_state::diagnose_segment(&StdFs, &base.join(&f.path)) {
                return Err(corrupt(e));
            }
            continue;
        }
        let dir = match &scratch {
            Some(d) => d,
            None => scratch.insert(
                tempfile::Builder::new()
                    .prefix("weir-verify-")
                    .tempdir()
                    .map_err(|source| {
                        SegmentsFailed::Scratch(IoError::Os {
                            op: "create a scratch directory in",
                            path: std::env::temp_dir(),
                            source,
                        })
                    })?,
            ),
        };
        let copy = dir.path().join("content");
        match copy_out(f, &copy) {
            Ok(_) => {}
            Err(CheckpointError::Format(e)) => return Err(corrupt(e)),
            Err(CheckpointError::Io(e)) => return Err(unread(e)),
            Err(e) => {
                return Err(unread(IoError::Os {
                    op: "copy",
                    path: base.join(&f.path),
                    source: std::io::Error::other(e.to_string()),
                }))
            }
        }
        let found = weir_state::diagnose_segment(&StdFs, &copy);
        // The copy goes before the next one is made (a checkpoint of many large segments).
        let _ = std::fs::remove_file(&copy);
        if let Some(e) = found {
            let framed = base.join(&f.path);
            let content =
                PathBuf::from(format!("{} (content of the framed file)", framed.display()));
            return Err(corrupt(e.in_file(content)));
        }
    }
    Ok(())
}

/// Why [`check_segments`] failed.
enum SegmentsFailed {
    /// A segment failed its checks or could not be read: the checkpoint fails verification,
    /// as when its CRCs do (exit code 3).
    Verify(VerifyError),
    /// No scratch directory for a framed segment's copy: this machine's problem, not the
    /// checkpoint's (exit code 1).
    Scratch(IoError),
    /// The runtime's metadata sections disagree with each other (exit code 3).
    Sections(String),
}

impl SegmentsFailed {
    /// The failure of verifying `what` (a job or savepoint directory).
    fn into_failed(self, what: &str) -> VerifyFailed {
        match self {
            SegmentsFailed::Verify(e) => VerifyFailed::Corrupt(format!("{what}: {e}")),
            SegmentsFailed::Scratch(e) => VerifyFailed::Other(format!("{what}: {e}")),
            SegmentsFailed::Sections(e) => VerifyFailed::Corrupt(format!("{what}: {e}")),
        }
    }
}

/// Whether checkpoint `id` still has a metadata file (a verifying, or a corrupt, one).
fn still_there(s: &CheckpointStorage, id: u64) -> bool {
    s.list().map_or(true, |l| {
        l.iter()
            .any(|i| i.id == id && (i.complete || i.metadata_corrupt))
    })
}

/// The checkpoint that the job's `COMPLETED` record names (`only`: if it is that one) when no
/// checkpoint at least as new has a `_metadata`: one that completed, its sinks' output
/// perhaps committed, and whose metadata was removed since (retention never drops the newest
/// complete checkpoint, and a crash never leaves that record naming one that did not
/// complete). A restore refuses to start then, so `verify` reports it as corruption.
fn completed_without_metadata(s: &CheckpointStorage, only: Option<u64>) -> Option<u64> {
    // Only from a listing the record did not change across (see `listing`).
    let l = listing(s).ok().filter(|l| l.stable)?;
    let done = l.marker.filter(|&d| only.is_none_or(|n| n == d))?;
    (!kept_since(&l.infos, done)).then_some(done)
}

/// The error of the job's `COMPLETED` record when it does not decode and no checkpoint has a
/// `_metadata`: a restore stops there (see `latest_restore` in the runtime). A record torn by
/// a crash beside checkpoints that kept their metadata is no corruption: only `COMPLETED`
/// is written without a sync.
fn damaged_record_without_metadata(s: &CheckpointStorage) -> Option<CheckpointError> {
    let e = s.completed_record().err()?;
    let listed = s.list().ok()?;
    (!kept_since(&listed, 0)).then_some(e)
}

/// What [`damaged_record_without_metadata`] found, said of `job`.
fn damaged_record_message(job: &str, e: &CheckpointError) -> String {
    format!(
        "{job}: {e}: the record of the newest completed checkpoint does not decode, and no \
         checkpoint has a {}: one completed and its metadata was removed since, so a restore \
         stops rather than start from the beginning, which could commit output twice",
        weir_io::METADATA_FILE
    )
}

/// Whether `listed` holds a checkpoint at least as new as `done` with a `_metadata`.
fn kept_since(listed: &[weir_io::CheckpointInfo], done: u64) -> bool {
    listed
        .iter()
        .any(|i| i.id >= done && (i.complete || i.metadata_corrupt))
}

/// See [`completed_without_metadata`].
fn completed_metadata_gone(s: &CheckpointStorage, job: &str, done: u64) -> VerifyFailed {
    VerifyFailed::Corrupt(format!(
        "{job}: checkpoint {done} completed ({} in {} names it) but its {} is gone: a \
         restore stops rather than start from an older checkpoint or the beginning, which \
         could commit output twice",
        weir_io::COMPLETED_FILE,
        s.job_dir().display(),
        s.job_dir()
            .join(weir_io::checkpoint_dir_name(done))
            .join(weir_io::METADATA_FILE)
            .display()
    ))
}

/// A metadata read that failed: a corrupt file is [`VerifyFailed::Corrupt`] (exit 3).
fn metadata_failed(what: &str, e: CheckpointError) -> VerifyFailed {
    let msg = format!("{what}: {e}");
    match e {
        CheckpointError::Format(_) => VerifyFailed::Corrupt(msg),
        _ => VerifyFailed::Other(msg),
    }
}

/// The verified metadata `a` designates.
fn inspected(a: &InspectArgs) -> Result<CheckpointMetadata, VerifyFailed> {
    if a.dir.join(weir_io::METADATA_FILE).is_file() {
        let shown = a.dir.display().to_string();
        // A `chk-<n>` directory is read through its job, which checks that it belongs there.
        let m = match chk_dir(&a.dir)? {
            Some((_, s, id)) => s.read_metadata(id),
            None => Savepoint::open(Arc::new(StdFs), &a.dir).map(|sp| sp.metadata().clone()),
        }
        .map_err(|e| metadata_failed(&shown, e))?;
        if let Some(n) = a.checkpoint.filter(|&n| n != m.checkpoint_id) {
            return Err(VerifyFailed::Other(format!(
                "{shown} is checkpoint {}, not {n}",
                m.checkpoint_id
            )));
        }
        return Ok(m);
    }
    let (job, s) = one_job(&a.dir).map_err(VerifyFailed::Other)?;
    let id = chosen(&job, &s, a.checkpoint)?;
    s.read_metadata(id).map_err(|e| metadata_failed(&job, e))
}

/// `weir checkpoints inspect`: what a checkpoint holds, from its metadata alone.
pub fn inspect(a: &InspectArgs) -> Result<(), VerifyFailed> {
    let m = inspected(a)?;
    let layout = weir_runtime::checkpoint::layout(&m).map_err(|e| {
        VerifyFailed::Corrupt(format!("{} checkpoint {}: {e}", m.job_id, m.checkpoint_id))
    })?;
    let kind = match m.kind {
        CheckpointKind::Savepoint => "savepoint",
        _ => "checkpoint",
    };
    let size_bytes = m.size_bytes();
    if a.json {
        let files: Vec<_> = m
            .files
            .iter()
            .map(|f| {
                serde_json::json!({
                    "path": f.path.display().to_string(),
                    "size_bytes": f.size_bytes,
                    "crc32": f.crc32,
                })
            })
            .collect();
        let logical: Vec<_> = m
            .logical_files
            .iter()
            .map(|l| {
                serde_json::json!({
                    "physical": l.physical.display().to_string(),
                    "offset": l.offset,
                    "size_bytes": l.size_bytes,
                    "crc32": l.crc32,
                })
            })
            .collect();
        let pair = |v: &[(String, u64)], name: &str| -> Vec<serde_json::Value> {
            v.iter()
                .map(|(p, n)| serde_json::json!({ name: p, "size_bytes": n }))
                .collect()
        };
        let parts: Vec<_> = layout
            .parts
            .iter()
            .map(|p| {
                serde_json::json!({
                    "shard": p.shard,
                    "operator": p.operator,
                    "kind": p.kind,
                    "inline_bytes": p.inline_bytes,
                    "files": pair(&p.files, "path"),
                    "logical_files": pair(&p.logical, "physical"),
                })
            })
            .collect();
        let v = serde_json::json!({
            "job": m.job_id,
            "checkpoint": m.checkpoint_id,
            "kind": kind,
            "trigger_timestamp_ms": m.trigger_timestamp_ms,
            "completion_timestamp_ms": m.completion_timestamp_ms,
            "size_bytes": size_bytes,
            "new_bytes": m.new_bytes,
            "shards": layout.shards,
            "max_parallelism": layout.max_parallelism,
            "format_version": layout.format_version,
            "files": files,
            "logical_files": logical,
            "parts": parts,
        });
        println!("{v}");
        return Ok(());
    }
    println!("job {}  {kind} {}", m.job_id, m.checkpoint_id);
    println!(
        "triggered_ms {}  completed_ms {}",
        m.trigger_timestamp_ms, m.completion_timestamp_ms
    );
    println!(
        "size_bytes {size_bytes}  new_bytes {}  files {}  logical_files {}",
        m.new_bytes,
        m.files.len(),
        m.logical_files.len()
    );
    println!(
        "shards {}  max_parallelism {}  format_version {}",
        layout.shards, layout.max_parallelism, layout.format_version
    );
    println!(
        "{:>5} {:<24} {:<11} {:>12} {:>6} {:>14} {:>8} {:>14}",
        "shard",
        "operator",
        "kind",
        "inline_bytes",
        "files",
        "file_bytes",
        "logical",
        "logical_bytes"
    );
    for p in &layout.parts {
        println!(
            "{:>5} {:<24} {:<11} {:>12} {:>6} {:>14} {:>8} {:>14}",
            p.shard,
            p.operator,
            p.kind,
            p.inline_bytes,
            p.files.len(),
            p.files.iter().map(|f| f.1).fold(0, u64::saturating_add),
            p.logical.len(),
            // Sizes as a (maybe forged) checkpoint states them: saturated, never wrapped.
            p.logical.iter().map(|f| f.1).fold(0, u64::saturating_add)
        );
    }
    Ok(())
}

/// `weir checkpoints clean`: keep the newest complete checkpoints of each job and delete
/// everything nothing kept refers to. Takes the job directory's lock, so it refuses to run
/// beside the job. A job whose `RUN_ORIGIN` does not decode is left whole: retention keeps
/// the checkpoint that record names (what a restore from `latest` continues before the run
/// took a checkpoint of its own), and which one that is cannot be known; it is reported as
/// `verify` reports it (an error line naming the file and offset), the other jobs are
/// cleaned, and the exit code is 3. Before, such a job was cleaned as if it had no record,
/// deleting the checkpoint `verify` said to restore by its path.
pub fn clean(a: &CleanArgs) -> Result<(), VerifyFailed> {
    let mut refused = Vec::new();
    for (root, job) in jobs(&a.dir).map_err(VerifyFailed::Other)? {
        let job_dir = root.join(&job);
        let failed =
            |e: &dyn std::fmt::Display| VerifyFailed::Other(format!("{}: {e}", job_dir.display()));
        let options = weir_runtime::checkpoint::storage_options();
        let s = CheckpointStorage::open_with(Arc::new(StdFs), &root, &job, options)
            .map_err(|e| failed(&e))?;
        // Read under the lock `open_with` took: no run records another meanwhile.
        match s.run_origin() {
            Ok(_) => {}
            Err(e @ CheckpointError::Format(_)) => {
                eprintln!(
                    "error: {job}: {e}: the record of where the last run started does not \
                     decode, so which checkpoint a restore from latest continues is unknown, \
                     and retention could delete it: nothing of {} was cleaned (restore a \
                     checkpoint or savepoint by its path, or remove the record, then clean)",
                    job_dir.display()
                );
                refused.push(job);
                continue;
            }
            Err(e) => {
                return Err(failed(&format_args!(
                    "the record of where the last run started cannot be read, so nothing of \
                     the job was cleaned: {e}"
                )))
            }
        }
        let keep = usize::try_from(a.keep).unwrap_or(usize::MAX);
        let r = s.retain(keep).map_err(|e| failed(&e))?;
        let kept: Vec<u64> = s
            .list()
            .map_err(|e| failed(&e))?
            .iter()
            .filter(|i| i.complete)
            .map(|i| i.id)
            .collect();
        let ids = |v: &[u64]| v.iter().map(u64::to_string).collect::<Vec<_>>().join(",");
        println!(
            "{job}: kept [{}], dropped [{}], removed incomplete [{}], deleted {} files",
            ids(&kept),
            ids(&r.dropped_checkpoints),
            ids(&r.removed_incomplete),
            r.deleted_files.len()
        );
    }
    if !refused.is_empty() {
        return Err(VerifyFailed::Corrupt(format!(
            "{}: not cleaned, as its record of where the last run started is damaged (named \
             above): {}",
            a.dir.display(),
            refused.join(", ")
        )));
    }
    Ok(())
}

/// Checkpoint `n` if given, else the job's newest complete one. A newer checkpoint whose
/// metadata is corrupt is reported (exit 3) rather than passed over: it did complete (see
/// `CheckpointInfo::metadata_corrupt`), so the newest complete one is not the job's latest.
/// So is one that `COMPLETED` names whose metadata (or whole directory) is gone, and a
/// `COMPLETED` that does not decode when no checkpoint has a metadata file: as `verify`
/// reports them, and a restore stops at them. `inspect` and `savepoint` fell back to an
/// older checkpoint (exit 0), or said there was none (exit 1).
fn chosen(job: &str, s: &CheckpointStorage, n: Option<u64>) -> Result<u64, VerifyFailed> {
    if let Some(id) = n {
        return Ok(id);
    }
    if let Some(done) = completed_without_metadata(s, None) {
        return Err(completed_metadata_gone(s, job, done));
    }
    // See `listing`: beside a running job a listing found no complete checkpoint.
    let found = listing(s)
        .map_err(|e| VerifyFailed::Other(format!("{job}: {e}")))?
        .infos
        .into_iter()
        .filter(|i| i.complete || i.metadata_corrupt)
        .max_by_key(|i| i.id);
    match found {
        Some(i) if i.complete => Ok(i.id),
        Some(i) => Err(VerifyFailed::Corrupt(format!(
            "{job}: checkpoint {}: {}",
            i.id,
            i.problem
                .as_deref()
                .unwrap_or("its metadata does not verify")
        ))),
        None => match settled(|| damaged_record_without_metadata(s)) {
            Some(e) => Err(VerifyFailed::Corrupt(damaged_record_message(job, &e))),
            None => Err(VerifyFailed::Other(format!(
                "{job}: no complete checkpoint"
            ))),
        },
    }
}

/// The one job `dir` designates, opened for reading.
fn one_job(dir: &Path) -> Result<(String, CheckpointStorage), String> {
    let mut jobs = jobs(dir)?;
    if jobs.len() > 1 {
        let names: Vec<_> = jobs.iter().map(|(_, j)| j.as_str()).collect();
        return Err(format!(
            "{}: holds the jobs {}; name one's directory",
            dir.display(),
            names.join(", ")
        ));
    }
    let (root, job) = jobs.remove(0);
    let s = open(&root, &job)?;
    Ok((job, s))
}

/// `weir checkpoints savepoint`: copy a complete checkpoint into a self-contained savepoint
/// directory, verified before its metadata is published. Reads only: it may run beside the
/// job (if the job's retention deletes the checkpoint meanwhile, the copy fails; run it again).
pub fn savepoint(a: &SavepointArgs) -> Result<(), VerifyFailed> {
    // `--to` is made by the export, once it checked that the directory is not in the job's
    // (and that the checkpoint verifies); made here first, a refused export left it behind,
    // intermediate directories with it. What the export made of it goes again on a failure.
    let made = missing_dirs(&weir_io::resolved_path(&a.to));
    let r = export(a);
    if r.is_err() {
        for d in &made {
            // Only if empty: never what another process put there meanwhile.
            let _ = std::fs::remove_dir(d);
        }
    }
    r
}

/// The directories of `dir` (resolved: no `..` in it, which would name another directory
/// once the one before it exists) and its ancestors that do not exist, deepest first.
fn missing_dirs(dir: &Path) -> Vec<PathBuf> {
    dir.ancestors()
        .take_while(|d| !d.as_os_str().is_empty() && !d.exists())
        .map(Path::to_path_buf)
        .collect()
}

/// See [`savepoint`].
fn export(a: &SavepointArgs) -> Result<(), VerifyFailed> {
    let (job, s) = one_job(&a.dir).map_err(VerifyFailed::Other)?;
    // The newest checkpoint of a running job may be dropped by its retention while it is
    // copied (there is no pin across processes): copy the newest again (`SAVEPOINT_ROUNDS`), as
    // `verify` does. Before, such a run failed with "checkpoint N not found".
    let mut round = 0;
    loop {
        round += 1;
        let id = chosen(&job, &s, a.checkpoint)?;
        match s.export_savepoint(id, &a.to, &weir_io::savepoint_dir_name(id)) {
            Ok(path) => {
                println!("{}", path.display());
                return Ok(());
            }
            Err(_)
                if a.checkpoint.is_none() && round < SAVEPOINT_ROUNDS && !still_there(&s, id) => {}
            Err(e) if a.checkpoint.is_none() && !still_there(&s, id) => {
                return Err(VerifyFailed::Other(format!(
                    "{job}: the newest checkpoint was removed by the job's retention while \
                     it was copied, {SAVEPOINT_ROUNDS} times (last: checkpoint {id}: {e}): the \
                     job completes checkpoints faster than they copy; keep more of them \
                     (--retained), or stop the job with a savepoint (SIGTERM)"
                )));
            }
            Err(e) => {
                // As `verify` classifies them: a file that is there but wrong is corruption.
                let corrupt = match &e {
                    CheckpointError::Verify(VerifyError::NotFound { .. }) => false,
                    CheckpointError::Format(_) | CheckpointError::Verify(_) => true,
                    _ => false,
                };
                let msg = format!("{job} checkpoint {id}: {e}");
                return Err(if corrupt {
                    VerifyFailed::Corrupt(msg)
                } else {
                    VerifyFailed::Other(msg)
                });
            }
        }
    }
}
