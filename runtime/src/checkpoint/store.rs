//! The runtime's view of checkpoint storage: the few operations the coordinator and the
//! shards' background threads use, over [`weir_io::CheckpointStorage`].

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use weir_io::{
    CheckpointStorage, CheckpointWriter, CommitInfo as IoCommitInfo, FileRef, LogicalFileRef,
    PendingCheckpoint, Savepoint, SmallFileKind,
};

use super::restore::CheckpointReader;
use super::snapshot::{FileRefData, LogicalRefData};

/// What committing a checkpoint wrote.
pub(crate) struct CommitInfo {
    pub new_bytes: u64,
    pub full_bytes: u64,
}

pub(crate) trait CheckpointStore: Send + Sync {
    fn begin(&self, id: u64) -> Result<(), String>;
    /// Puts an immutable local file into shared storage for checkpoint `id`; `size_bytes` and
    /// `crc32` are its writer's (see `CheckpointWriter::upload_shared_known`). `copy`: never
    /// as a link (a full checkpoint's, which shares nothing with another).
    fn upload_shared(
        &self,
        id: u64,
        shard: usize,
        src: &Path,
        size_bytes: u64,
        crc32: u32,
        copy: bool,
    ) -> Result<FileRefData, String>;
    /// Checkpoint `id` references a shared file an earlier checkpoint uploaded; `false`: that
    /// file is gone (retention dropped the checkpoints that held it), upload the segment.
    fn reuse_shared(&self, id: u64, shard: usize, f: &FileRefData) -> Result<bool, String>;
    /// Appends a small file to the shard's merged task-owned file of checkpoint `id`.
    fn write_small(&self, id: u64, shard: usize, bytes: &[u8]) -> Result<LogicalRefData, String>;
    /// Makes checkpoint `id` complete: every file synced, then the metadata durable.
    fn commit(
        &self,
        id: u64,
        trigger_ms: u64,
        sections: Vec<(String, Vec<u8>)>,
    ) -> Result<CommitInfo, String>;
    fn abort(&self, id: u64);
    fn retain(&self, keep: usize) -> Result<(), String>;
    /// Hold complete checkpoint `id` against retention (for a savepoint copied out of it).
    fn pin(&self, id: u64) -> Result<weir_io::CheckpointPin, String>;
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

pub(crate) fn to_ref(f: &FileRefData) -> FileRef {
    FileRef {
        path: PathBuf::from(&f.path),
        size_bytes: f.size_bytes,
        crc32: f.crc32,
    }
}

fn from_ref(f: &FileRef) -> FileRefData {
    FileRefData {
        path: f.path.to_string_lossy().into_owned(),
        size_bytes: f.size_bytes,
        crc32: f.crc32,
    }
}

pub(crate) fn to_logical(f: &LogicalRefData) -> LogicalFileRef {
    LogicalFileRef {
        physical: PathBuf::from(&f.physical),
        offset: f.offset,
        size_bytes: f.size_bytes,
        first_block: f.first_block,
        crc32: f.crc32,
    }
}

/// Checkpoint storage on the local file system.
pub(crate) struct IoCheckpointStore {
    pub storage: CheckpointStorage,
    pending: Mutex<HashMap<u64, PendingCheckpoint>>,
    /// The idle writers of small files per (checkpoint, shard), so that they merge into few
    /// physical files. Usually one; more when several threads of a shard write at once (the
    /// channel state of two unaligned exchange inputs): each takes an idle writer or makes a
    /// new one, and puts it back beside the others. With one slot, the second put replaced
    /// the first writer, which was dropped unfinished and failed the checkpoint.
    small: Mutex<HashMap<(u64, usize), Vec<CheckpointWriter>>>,
    /// The highest checkpoint id begun in this job, by any attempt: a restarted attempt's
    /// ids come after it (see [`Self::highest_begun`]).
    highest_begun: std::sync::atomic::AtomicU64,
}

impl IoCheckpointStore {
    pub fn new(storage: CheckpointStorage) -> Self {
        Self {
            storage,
            pending: Mutex::new(HashMap::new()),
            small: Mutex::new(HashMap::new()),
            highest_begun: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// The highest checkpoint id begun through this store. Ids must never repeat within a
    /// job (as Flink's checkpoint id counter): a checkpoint in progress when its attempt
    /// failed has no directory yet, so listing the storage does not show its id, and a
    /// restart that took the id again received the failed attempt's straggling uploads
    /// (whose files its dropped stores were deleting) into its own checkpoint, which then
    /// failed.
    pub fn highest_begun(&self) -> u64 {
        self.highest_begun
            .load(std::sync::atomic::Ordering::Acquire)
    }

    /// Keeps `w` for shard `shard`'s next small file of checkpoint `id`, only while that is in
    /// progress: put back after an abort emptied `small` (a subsumed checkpoint's channel
    /// state still being written), nothing would drop it, and it kept the checkpoint
    /// registered as in progress until the job ended. `abort` removes the pending entry
    /// first, and this checks it under `small`'s lock.
    fn keep_small(&self, id: u64, shard: usize, w: CheckpointWriter) {
        let mut small = lock(&self.small);
        if lock(&self.pending).contains_key(&id) {
            small.entry((id, shard)).or_default().push(w);
        }
    }

    fn writer(&self, id: u64) -> Result<CheckpointWriter, String> {
        lock(&self.pending)
            .get(&id)
            .map(|p| p.writer())
            .ok_or_else(|| format!("checkpoint {id} is not in progress"))
    }
}

impl CheckpointStore for IoCheckpointStore {
    fn begin(&self, id: u64) -> Result<(), String> {
        self.highest_begun
            .fetch_max(id, std::sync::atomic::Ordering::AcqRel);
        let p = self.storage.begin(id).map_err(|e| e.to_string())?;
        lock(&self.pending).insert(id, p);
        Ok(())
    }

    fn upload_shared(
        &self,
        id: u64,
        shard: usize,
        src: &Path,
        size_bytes: u64,
        crc32: u32,
        copy: bool,
    ) -> Result<FileRefData, String> {
        let mut w = self.writer(id)?;
        let hint = format!(
            "s{shard}-{}",
            src.file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default()
        );
        let r = if copy {
            w.copy_shared_known(src, &hint, size_bytes, crc32)
        } else {
            w.upload_shared_known(src, &hint, size_bytes, crc32)
        }
        .map_err(|e| e.to_string())?;
        w.finish().map_err(|e| e.to_string())?;
        Ok(from_ref(&r))
    }

    fn reuse_shared(&self, id: u64, _shard: usize, f: &FileRefData) -> Result<bool, String> {
        let mut w = self.writer(id)?;
        let reused = match w.reuse_shared(&to_ref(f)) {
            Ok(()) => true,
            Err(weir_io::CheckpointError::MissingReusedFile { .. }) => false,
            Err(e) => return Err(e.to_string()),
        };
        w.finish().map_err(|e| e.to_string())?;
        Ok(reused)
    }

    fn write_small(&self, id: u64, shard: usize, bytes: &[u8]) -> Result<LogicalRefData, String> {
        let taken = lock(&self.small).get_mut(&(id, shard)).and_then(Vec::pop);
        let mut w = match taken {
            Some(w) => w,
            None => self.writer(id)?,
        };
        let r = w
            .write_small(bytes, SmallFileKind::TaskOwned)
            .map_err(|e| e.to_string())?;
        self.keep_small(id, shard, w);
        Ok(LogicalRefData {
            physical: r.physical.to_string_lossy().into_owned(),
            offset: r.offset,
            size_bytes: r.size_bytes,
            first_block: r.first_block,
            crc32: r.crc32,
        })
    }

    fn commit(
        &self,
        id: u64,
        trigger_ms: u64,
        sections: Vec<(String, Vec<u8>)>,
    ) -> Result<CommitInfo, String> {
        let writers: Vec<CheckpointWriter> = {
            let mut small = lock(&self.small);
            let keys: Vec<(u64, usize)> = small.keys().filter(|(c, _)| *c == id).copied().collect();
            keys.into_iter()
                .filter_map(|k| small.remove(&k))
                .flatten()
                .collect()
        };
        for w in writers {
            w.finish().map_err(|e| e.to_string())?;
        }
        let pending = lock(&self.pending)
            .remove(&id)
            .ok_or_else(|| format!("checkpoint {id} is not in progress"))?;
        let done = self
            .storage
            .commit(
                pending,
                IoCommitInfo {
                    trigger_timestamp_ms: trigger_ms,
                    completion_timestamp_ms: super::coordinator::now_ms(),
                    sections,
                },
            )
            .map_err(|e| e.to_string())?;
        Ok(CommitInfo {
            new_bytes: done.metadata.new_bytes,
            full_bytes: self.storage.stored_bytes(&done.metadata),
        })
    }

    fn abort(&self, id: u64) {
        // The pending entry first: `write_small` keeps a writer only while it is there.
        let pending = lock(&self.pending).remove(&id);
        lock(&self.small).retain(|(c, _), _| *c != id);
        if let Some(p) = pending {
            if let Err(e) = self.storage.abort(p) {
                tracing::warn!("aborting checkpoint {id}: {e}");
            }
        }
    }

    fn retain(&self, keep: usize) -> Result<(), String> {
        self.storage
            .retain(keep)
            .map(|_| ())
            .map_err(|e| e.to_string())
    }

    fn pin(&self, id: u64) -> Result<weir_io::CheckpointPin, String> {
        self.storage.pin(id).map_err(|e| e.to_string())
    }
}

/// Reads a complete checkpoint of a job's storage.
pub(crate) struct StorageReader(pub CheckpointStorage);

/// Reads a savepoint directory.
pub(crate) struct SavepointReader(pub Savepoint);

/// Both read verified files the same way; only the directory they resolve paths in differs.
macro_rules! checkpoint_reader {
    ($t:ty, $base:ident) => {
        impl CheckpointReader for $t {
            fn link_file_to(
                &self,
                f: &FileRefData,
                dest: &Path,
            ) -> Result<(), weir_io::CheckpointError> {
                self.0.link_file_to(&to_ref(f), dest).map(|_| ())
            }
            fn read_logical(&self, f: &LogicalRefData) -> Result<Vec<u8>, String> {
                self.0
                    .read_logical(&to_logical(f))
                    .map_err(|e| e.to_string())
            }
            fn path_of(&self, f: &FileRefData) -> std::path::PathBuf {
                self.0.$base().join(&f.path)
            }
        }
    };
}

checkpoint_reader!(StorageReader, job_dir);
checkpoint_reader!(SavepointReader, dir);

#[cfg(test)]
mod tests {
    use super::*;

    /// A small-file writer whose write ends after its checkpoint was aborted (subsumed, say)
    /// is dropped, not kept: kept, nothing removed it, and the aborted checkpoint stayed
    /// registered as in progress, holding its files against retention, until the job ended.
    #[test]
    fn a_small_file_writer_of_an_aborted_checkpoint_is_not_kept() {
        let tmp = tempfile::tempdir().expect("tmp");
        let fs: std::sync::Arc<dyn weir_io::Fs> = std::sync::Arc::new(weir_io::StdFs);
        let storage = CheckpointStorage::open(fs, tmp.path(), "job").expect("storage");
        let store = IoCheckpointStore::new(storage);
        store.begin(1).expect("begin");
        store
            .write_small(1, 0, b"kept while in progress")
            .expect("write");
        assert_eq!(lock(&store.small).get(&(1, 0)).map(Vec::len), Some(1));
        // A write in flight: its writer was taken before the abort, put back after it.
        let w = lock(&store.small)
            .get_mut(&(1, 0))
            .and_then(Vec::pop)
            .expect("the kept writer");
        store.abort(1);
        store.keep_small(1, 0, w);
        assert!(lock(&store.small).is_empty(), "kept after the abort");
    }

    /// Two threads of a shard writing small files of one checkpoint at once (the channel state
    /// of two unaligned exchange inputs) each get a writer; the checkpoint commits, and every
    /// piece reads back. With one writer slot per shard, a writer put back over another
    /// dropped that one unfinished and the commit failed.
    #[test]
    fn concurrent_small_files_of_one_shard_all_commit() {
        let tmp = tempfile::tempdir().expect("tmp");
        let fs: std::sync::Arc<dyn weir_io::Fs> = std::sync::Arc::new(weir_io::StdFs);
        let storage = CheckpointStorage::open(fs, tmp.path(), "job").expect("storage");
        let store = std::sync::Arc::new(IoCheckpointStore::new(storage));
        store.begin(1).expect("begin");
        let barrier = std::sync::Arc::new(std::sync::Barrier::new(2));
        let threads: Vec<_> = (0..2u8)
            .map(|t| {
                let (store, barrier) = (store.clone(), barrier.clone());
                std::thread::spawn(move || {
                    barrier.wait();
                    (0..1000u32)
                        .map(|i| {
                            let bytes = vec![t; 1 + i as usize % 97];
                            let r = store.write_small(1, 0, &bytes).expect("write");
                            (r, bytes)
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        let written: Vec<_> = threads
            .into_iter()
            .flat_map(|t| t.join().expect("writer thread"))
            .collect();
        store.commit(1, 1, Vec::new()).expect("commit");
        for (r, bytes) in written {
            assert_eq!(
                store.storage.read_logical(&to_logical(&r)).expect("read"),
                bytes
            );
        }
    }
}
