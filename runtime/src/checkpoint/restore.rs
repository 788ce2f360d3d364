//! What a job restores from: a complete checkpoint's metadata, decoded and validated, and a
//! reader of the files it references.

use std::collections::BTreeSet;
use std::path::Path;
use std::sync::{Arc, Mutex};

use super::snapshot::{
    decode_job, decode_shard, shard_section, FileRefData, LogicalRefData, Part, PartKind,
    ShardSnapshot, JOB_SECTION,
};

/// Reads files of one checkpoint (or savepoint), verifying every CRC before returning a byte.
pub(crate) trait CheckpointReader: Send + Sync {
    /// Gives the new file `dest` the content of `f`: a raw file becomes a hard link once its
    /// length is checked, without reading it; a framed one is copied, verified, without being
    /// held in memory (`dest` is removed on error). For segments only, after the checkpoint
    /// verified: the store that opens `dest` checks every block, then size and whole-file CRC
    /// against its handle, which the caller has compared with `f`.
    fn link_file_to(&self, f: &FileRefData, dest: &Path) -> Result<(), String>;
    /// Where `f` is: what an error about a link to it names as well.
    fn path_of(&self, f: &FileRefData) -> std::path::PathBuf;
    fn read_logical(&self, f: &LogicalRefData) -> Result<Vec<u8>, String>;
}

/// A decoded checkpoint to restore from.
pub(crate) struct RestoreState {
    pub checkpoint_id: u64,
    pub shards: Vec<ShardSnapshot>,
    pub reader: Arc<dyn CheckpointReader>,
    /// The shard this restore state is handed to and the job's shard count now.
    pub new_shards: usize,
    /// The (operator, kind) pairs the job's operators asked for while they were built: what
    /// the restore hands to someone ([`Self::unclaimed`]).
    claimed: Mutex<BTreeSet<(String, u8)>>,
    /// The checkpoint is a complete one of the job's own checkpoint storage (a failover, or
    /// `--restore latest`): its shared files may be referenced by the job's next checkpoints
    /// instead of uploaded again.
    pub files_in_job_storage: bool,
}

impl RestoreState {
    /// Decodes the runtime's sections of a checkpoint's metadata.
    pub fn decode(
        checkpoint_id: u64,
        sections: &[(String, Vec<u8>)],
        reader: Arc<dyn CheckpointReader>,
        new_shards: usize,
        max_parallelism: u16,
    ) -> Result<Self, String> {
        let find = |name: &str| {
            sections
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, b)| b.as_slice())
        };
        let job =
            decode_job(find(JOB_SECTION).ok_or_else(|| {
                format!("checkpoint {checkpoint_id} has no section {JOB_SECTION}")
            })?)
            .map_err(|e| format!("checkpoint {checkpoint_id}, section {JOB_SECTION}: {e}"))?;
        if job.max_parallelism != max_parallelism {
            return Err(format!(
                "checkpoint {checkpoint_id} was taken with max parallelism {}, the job has {max_parallelism}: key groups would not match",
                job.max_parallelism
            ));
        }
        // Grown section by section: a count from the file cannot size an allocation (a forged
        // one with valid CRCs asked for 4 G shards, which aborted the process).
        let mut shards = Vec::new();
        for s in 0..job.shards as usize {
            let name = shard_section(s);
            let bytes = find(&name)
                .ok_or_else(|| format!("checkpoint {checkpoint_id} has no section {name}"))?;
            shards.push(
                decode_shard(bytes)
                    .map_err(|e| format!("checkpoint {checkpoint_id}, section {name}: {e}"))?,
            );
        }
        Ok(Self {
            checkpoint_id,
            shards,
            reader,
            new_shards,
            claimed: Mutex::default(),
            files_in_job_storage: false,
        })
    }

    /// The operators (uid and kind of state) that hold state in this checkpoint but that no
    /// operator of the job asked for: restoring would drop their state without a word.
    /// Parts without content (a source that had not started, a sink with nothing pending)
    /// do not count. Sorted, each once.
    pub fn unclaimed(&self) -> Vec<(String, PartKind)> {
        let claimed = self.claimed.lock().unwrap_or_else(|p| p.into_inner());
        let mut out: Vec<(String, PartKind)> = Vec::new();
        for p in self.shards.iter().flat_map(|s| s.parts.iter()) {
            let empty = p.bytes.is_empty() && p.files.is_empty() && p.logical.is_empty();
            if empty || claimed.contains(&(p.operator.clone(), p.kind as u8)) {
                continue;
            }
            if !out.iter().any(|(o, k)| *o == p.operator && *k == p.kind) {
                out.push((p.operator.clone(), p.kind));
            }
        }
        out.sort_by(|a, b| (&a.0, a.1 as u8).cmp(&(&b.0, b.1 as u8)));
        out
    }

    /// Every part of `operator` of `kind`, with the old shard that wrote it. Notes that the
    /// job has that operator (see [`Self::unclaimed`]).
    pub fn parts<'a>(
        &'a self,
        operator: &'a str,
        kind: PartKind,
    ) -> impl Iterator<Item = (usize, &'a Part)> + 'a {
        self.claimed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert((operator.to_owned(), kind as u8));
        self.shards.iter().enumerate().flat_map(move |(s, snap)| {
            snap.parts
                .iter()
                .filter(move |p| p.kind == kind && p.operator == operator)
                .map(move |p| (s, p))
        })
    }

    /// The parts of `operator` that new shard `shard` takes over for state that is not keyed
    /// (sources, sinks, watermarks): the same shard index, or, after a rescale, old shards
    /// `shard, shard + new_shards, ..`.
    pub fn parts_for_shard<'a>(
        &'a self,
        operator: &'a str,
        kind: PartKind,
        shard: usize,
    ) -> Vec<&'a Part> {
        self.parts(operator, kind)
            .filter(|(s, _)| s % self.new_shards == shard)
            .map(|(_, p)| p)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::snapshot::{encode, JobSnapshot, SECTIONS_VERSION};

    struct NoFiles;

    impl CheckpointReader for NoFiles {
        fn link_file_to(&self, _: &FileRefData, _: &Path) -> Result<(), String> {
            Err("no files".into())
        }
        fn path_of(&self, _: &FileRefData) -> std::path::PathBuf {
            std::path::PathBuf::new()
        }
        fn read_logical(&self, _: &LogicalRefData) -> Result<Vec<u8>, String> {
            Err("no files".into())
        }
    }

    fn job(shards: u32) -> (String, Vec<u8>) {
        let j = JobSnapshot {
            shards,
            max_parallelism: 128,
            format_version: SECTIONS_VERSION,
        };
        (JOB_SECTION.to_owned(), encode(&j))
    }

    /// A shard count from the metadata (valid CRCs, any value) names a missing section; it
    /// never sizes an allocation up front.
    #[test]
    fn a_forged_shard_count_is_an_error_naming_the_missing_section() {
        for shards in [u32::MAX, 3] {
            let mut sections = vec![job(shards)];
            sections.push((shard_section(0), encode(&ShardSnapshot::default())));
            let e = RestoreState::decode(7, &sections, Arc::new(NoFiles), 2, 128)
                .err()
                .expect("sections missing");
            assert_eq!(e, "checkpoint 7 has no section weir/shard-0001", "{shards}");
        }
        let sections = vec![
            job(1),
            (shard_section(0), encode(&ShardSnapshot::default())),
        ];
        let r = RestoreState::decode(7, &sections, Arc::new(NoFiles), 2, 128).expect("decodes");
        assert_eq!(r.shards.len(), 1);
    }
}
