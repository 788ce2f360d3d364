//! `weir checkpoints list|verify DIR`: the checkpoint directory needs nothing but itself.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use clap::Args;
use weir_io::{CheckpointStorage, StdFs, VerifyError};

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
    /// A checkpoint directory (holding job directories) or one job's directory.
    pub dir: PathBuf,
    /// Verify only checkpoint N (default: every complete checkpoint).
    #[arg(long)]
    pub checkpoint: Option<u64>,
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

/// The job directories DIR designates, as (root, job id).
fn jobs(dir: &Path) -> Result<Vec<(PathBuf, String)>, String> {
    let split = |p: &Path| -> Result<(PathBuf, String), String> {
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
    if is_job_dir(dir) {
        return Ok(vec![split(dir)?]);
    }
    let entries = std::fs::read_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let mut out = Vec::new();
    for e in entries.flatten() {
        let p = e.path();
        if is_job_dir(&p) {
            out.push(split(&p)?);
        }
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
    CheckpointStorage::open_read_only(Arc::new(StdFs), root, job)
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
        let mut infos = s.list().map_err(|e| e.to_string())?;
        infos.sort_by_key(|i| i.id);
        for i in infos {
            let status = if i.complete { "complete" } else { "incomplete" };
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

pub fn verify(a: &VerifyArgs) -> Result<(), VerifyFailed> {
    let jobs = jobs(&a.dir).map_err(VerifyFailed::Other)?;
    let mut checked = 0;
    for (root, job) in jobs {
        let s = open(&root, &job).map_err(VerifyFailed::Other)?;
        let ids: Vec<u64> = match a.checkpoint {
            Some(n) => vec![n],
            None => {
                let infos = s.list().map_err(|e| VerifyFailed::Other(e.to_string()))?;
                // A checkpoint whose metadata exists but does not decode is corrupt, not
                // merely incomplete: verify reports it.
                infos
                    .iter()
                    .filter(|i| i.complete || i.path.join(weir_io::METADATA_FILE).exists())
                    .map(|i| i.id)
                    .collect()
            }
        };
        for id in ids {
            match s.verify(id) {
                Ok(r) => {
                    checked += 1;
                    println!(
                        "ok {job} checkpoint {id}: {} files, {} logical files, {} bytes checked",
                        r.files, r.logical_files, r.bytes_checked
                    );
                }
                Err(e @ VerifyError::NotFound { .. }) if a.checkpoint.is_some() => {
                    return Err(VerifyFailed::Other(format!("{job}: {e}")))
                }
                Err(e) => return Err(VerifyFailed::Corrupt(format!("{job}: {e}"))),
            }
        }
    }
    if checked == 0 {
        return Err(VerifyFailed::Other(format!(
            "{}: no complete checkpoint to verify",
            a.dir.display()
        )));
    }
    Ok(())
}
