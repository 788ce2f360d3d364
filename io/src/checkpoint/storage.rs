//! [`CheckpointStorage`]: the directory layout, pending checkpoints and their writers, commit,
//! listing, retention and garbage collection, savepoint export.
//!
//! Invariants kept here (DESIGN.md section 3):
//! * A checkpoint is complete iff `chk-<n>/_metadata` exists and verifies. `commit` publishes
//!   the metadata only after every data file and the directory entries naming them are durable.
//! * GC deletes a data file only when no retained checkpoint references it, no in-progress
//!   checkpoint registered it, and the checkpoint that created it is not newer than the newest
//!   complete one. Metadata goes first (and durably), files after.
//! * `commit` and `retain` exclude each other (the GC lock), so a reused file cannot vanish
//!   between the check that it exists and the publication of the metadata naming it.

use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::checkpoint::error::{is_not_found, CheckpointError, VerifyError};
use crate::checkpoint::format::{
    checkpoint_dir_name, data_file_name, is_lower_hex, parse_checkpoint_dir_name,
    parse_data_file_name, parse_id, raw_file_name, sanitize_hint, CheckpointKind,
    CheckpointMetadata, DataHeader, FileRef, LogicalFileRef, SmallFileKind, COMPLETED_FILE,
    DATA_BLOCK_KIND, DATA_HEADER_LEN, FILE_KIND_MERGED_SHARED, FILE_KIND_MERGED_TASKOWNED,
    FILE_KIND_UPLOAD, METADATA_FILE, RUN_ORIGIN_FILE, SHARED_DIR, TASKOWNED_DIR,
};
use crate::checkpoint::read::{
    copy_span_to, link_span_to, read_metadata_file, read_span, verify_files, RawDiagnose, Span,
    VerifyReport,
};
use crate::error::{FormatError, IoError};
use crate::frame::{crc32, encode_block, BlockHeader};
use crate::fs::{create_dir_all_durable, publish_file, DirLock, Fs, FsFile};

/// Tunables of checkpoint storage.
#[derive(Debug, Clone, Copy)]
pub struct StorageOptions {
    /// A merged physical file is rolled when the next logical file would take it past this.
    pub physical_file_bytes_max: u64,
    /// Content bytes per framed block (each block carries its own header and CRC).
    pub block_payload_bytes_max: u32,
    /// Upload immutable files as raw files: a hard link to the source, no copy (see
    /// [`CheckpointWriter::upload_shared`]). Off, or where the link fails, they are copied and
    /// framed in blocks.
    pub link_uploads: bool,
    /// Where a raw file fails its whole-file CRC, find the damaged part from the file's own
    /// format (see [`RawDiagnose`]), so that the error names its offset. `None` by default:
    /// storage knows no file formats; the runtime and the `weir` tool pass the state crate's
    /// segment check.
    pub raw_diagnose: Option<RawDiagnose>,
}

impl Default for StorageOptions {
    fn default() -> Self {
        StorageOptions {
            physical_file_bytes_max: 64 << 20,
            block_payload_bytes_max: 1 << 20,
            link_uploads: true,
            raw_diagnose: None,
        }
    }
}

/// Copy and write buffers are at most this large.
const COPY_CHUNK_BYTES: usize = 4 << 20;

#[derive(Debug, Default)]
struct Registry {
    /// In-progress checkpoint id -> relative paths it created or reuses (GC skips them).
    in_progress: BTreeMap<u64, BTreeSet<PathBuf>>,
    latest_complete: Option<u64>,
    /// Complete checkpoints held by [`CheckpointPin`]s, with their pin counts: GC keeps them.
    pinned: BTreeMap<u64, usize>,
}

#[derive(Debug)]
struct Shared {
    fs: Arc<dyn Fs>,
    job_id: String,
    job_dir: PathBuf,
    options: StorageOptions,
    read_only: bool,
    /// Upper 32 bits of every file id this instance makes; the lower 32 count.
    session: u64,
    next_file: AtomicU32,
    registry: Mutex<Registry>,
    /// Held by `commit` (check reused files, publish) and by `retain` (decide, delete).
    gc: Mutex<()>,
    _lock: Option<DirLock>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // The protected data stays consistent at every await-free step; a panic elsewhere must not
    // make the storage unusable.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Shared {
    fn next_file_id(&self) -> u64 {
        (self.session << 32) | u64::from(self.next_file.fetch_add(1, Ordering::Relaxed))
    }
    fn chk_dir(&self, id: u64) -> PathBuf {
        self.job_dir.join(checkpoint_dir_name(id))
    }
    fn writable(&self, operation: &'static str) -> Result<(), CheckpointError> {
        if self.read_only {
            return Err(CheckpointError::ReadOnly {
                path: self.job_dir.clone(),
                operation,
            });
        }
        Ok(())
    }
}

/// A fresh value per storage instance, so file ids (and names) of two runs never collide.
fn session_nonce() -> u64 {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    let mut z = nanos
        ^ u64::from(std::process::id()).rotate_left(32)
        ^ COUNTER
            .fetch_add(1, Ordering::Relaxed)
            .wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    (z ^ (z >> 31)) & 0xffff_ffff
}

/// Whether `s` may name a job (its directory under the checkpoint directory) or a savepoint:
/// 1 to 200 of `[A-Za-z0-9._-]`, not `.` or `..`. Configurations check job ids with it
/// before any storage is opened.
pub fn is_valid_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 200
        && s != "."
        && s != ".."
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

/// What [`is_valid_name`] wants, for errors.
pub const VALID_NAME: &str = "use 1 to 200 of [A-Za-z0-9._-], not . or ..";

fn check_name(what: &'static str, s: &str) -> Result<(), CheckpointError> {
    if is_valid_name(s) {
        Ok(())
    } else {
        Err(CheckpointError::InvalidArgument {
            what,
            reason: format!("{s:?}: {VALID_NAME}"),
        })
    }
}

/// Replace `<job_dir>/COMPLETED` with `id` and its CRC (see
/// [`CheckpointStorage::completed_marker`]): through a temporary file and a rename, so that a
/// reader sees the old record or the new one.
fn write_completed_marker(fs: &dyn Fs, job_dir: &Path, id: u64) -> Result<(), IoError> {
    let path = job_dir.join(COMPLETED_FILE);
    let tmp = job_dir.join(format!("{COMPLETED_FILE}.tmp"));
    match fs.remove(&tmp) {
        Err(e) if !is_not_found(&e) => return Err(e),
        _ => {}
    }
    let mut f = fs.create(&tmp)?;
    let id = id.to_string();
    let crc = crc32(&[id.as_bytes()]);
    f.write_at(0, format!("{id} {crc:08x}\n").as_bytes())?;
    drop(f);
    fs.rename(&tmp, &path)
}

/// Where the newest run of a job directory started ([`CheckpointStorage::run_origin`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunOrigin {
    /// The run's first checkpoint id: every checkpoint it took has this id or a higher one.
    pub first_id: u64,
    /// The checkpoint or savepoint the run restored: its id and absolute path (a checkpoint
    /// of the same job directory is recorded by its name, and read back under the directory
    /// as it is now, so the record survives a move). `None`: the run started from the
    /// beginning.
    pub restored: Option<(u64, PathBuf)>,
}

/// The longest `RUN_ORIGIN` file read: a path is at most 4096 bytes on Linux.
const RUN_ORIGIN_MAX_BYTES: usize = 8192;

impl RunOrigin {
    /// `<first id> <restored id or -> <crc>\n<restored path>`, the CRC (CRC-32/IEEE, 8
    /// lowercase hex digits) over everything but itself and the space before it.
    fn encode(&self, job_dir: &Path) -> Vec<u8> {
        let own = |id: u64, p: &Path| {
            let name = checkpoint_dir_name(id);
            (p.file_name().and_then(|n| n.to_str()) == Some(&name)
                && p.parent().map(crate::fs::resolved_path)
                    == Some(crate::fs::resolved_path(job_dir)))
            .then_some(name)
        };
        let (id, path): (String, Vec<u8>) = match &self.restored {
            Some((id, p)) => (
                id.to_string(),
                own(*id, p).map_or_else(|| p.as_os_str().as_bytes().to_vec(), String::into_bytes),
            ),
            None => ("-".into(), Vec::new()),
        };
        let path = &path[..];
        let head = format!("{} {id}", self.first_id);
        let crc = crc32(&[head.as_bytes(), b"\n", path]);
        let mut out = format!("{head} {crc:08x}\n").into_bytes();
        out.extend_from_slice(path);
        out
    }

    /// The record `bytes` of `file` spell, or why not with the offset; a checkpoint recorded
    /// by its name is under `job_dir`.
    fn decode(file: &Path, job_dir: &Path, bytes: &[u8]) -> Result<RunOrigin, CheckpointError> {
        let malformed = |offset: usize, reason: &str| {
            CheckpointError::Format(FormatError::Malformed {
                file: file.to_path_buf(),
                offset: offset as u64,
                reason: reason.to_string(),
            })
        };
        let Some(nl) = bytes.iter().position(|&b| b == b'\n') else {
            return Err(malformed(
                0,
                "no newline after `<first id> <restored id> <crc>`",
            ));
        };
        let Ok(line) = std::str::from_utf8(&bytes[..nl]) else {
            return Err(malformed(0, "the first line is not UTF-8"));
        };
        let path = &bytes[nl + 1..];
        let fields: Vec<&str> = line.split(' ').collect();
        let [first, restored, crc] = fields[..] else {
            return Err(malformed(0, "not `<first id> <restored id or -> <crc>`"));
        };
        let crc_at = first.len() + restored.len() + 2;
        if !is_lower_hex(crc, 8) {
            return Err(malformed(crc_at, "the CRC is not 8 lowercase hex digits"));
        }
        let head = &line[..crc_at - 1];
        let (stored, computed) = (
            u32::from_str_radix(crc, 16).unwrap_or(0),
            crc32(&[head.as_bytes(), b"\n", path]),
        );
        if stored != computed {
            return Err(CheckpointError::Format(FormatError::ChecksumMismatch {
                file: file.to_path_buf(),
                offset: crc_at as u64,
                expected: stored,
                actual: computed,
            }));
        }
        let Some(first_id) = parse_id(first) else {
            return Err(malformed(
                0,
                "the first id is not a checkpoint id in decimal",
            ));
        };
        let restored = match restored {
            "-" if path.is_empty() => None,
            "-" => return Err(malformed(nl + 1, "a path after `-` (nothing restored)")),
            id => {
                let at = first.len() + 1;
                let id = parse_id(id).ok_or_else(|| {
                    malformed(at, "the restored id is not a checkpoint id in decimal")
                })?;
                let p = PathBuf::from(std::ffi::OsStr::from_bytes(path));
                if p.as_os_str() == checkpoint_dir_name(id).as_str() {
                    Some((id, job_dir.join(p)))
                } else if p.is_absolute() {
                    Some((id, p))
                } else {
                    return Err(malformed(
                        nl + 1,
                        "the restored path is neither absolute nor this directory's chk-<id>",
                    ));
                }
            }
        };
        Ok(RunOrigin { first_id, restored })
    }
}

/// One `chk-<n>` directory as [`CheckpointStorage::list`] sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointInfo {
    pub id: u64,
    /// The `chk-<n>` directory.
    pub path: PathBuf,
    /// True iff `_metadata` exists and verifies.
    pub complete: bool,
    /// Bytes on disk of the files the checkpoint references (0 when incomplete; see
    /// [`CheckpointStorage::stored_bytes`]).
    pub size_bytes: u64,
    /// Bytes the checkpoint itself wrote (its incremental size; 0 when incomplete).
    pub new_bytes: u64,
    pub trigger_timestamp_ms: u64,
    pub completion_timestamp_ms: u64,
    /// Why the checkpoint is incomplete: no metadata, or the decode error.
    pub problem: Option<String>,
    /// True iff `_metadata` exists but does not verify. That is corruption, not a checkpoint
    /// cut short: the file is written whole, synced and then renamed into place, so a crash
    /// leaves either no `_metadata` or a complete one. A restore must not pass over it as if
    /// it had never completed (its sink transactions may be committed).
    pub metadata_corrupt: bool,
}

/// What [`CheckpointStorage::commit`] made durable.
#[derive(Debug, Clone)]
pub struct CompletedCheckpoint {
    pub metadata: CheckpointMetadata,
    /// The `chk-<n>/_metadata` file.
    pub metadata_path: PathBuf,
}

/// What the caller adds to a checkpoint's metadata at commit.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CommitInfo {
    pub trigger_timestamp_ms: u64,
    pub completion_timestamp_ms: u64,
    /// Opaque named sections (per-shard state handles, source positions, channel-state refs,
    /// sink transactions, metrics).
    pub sections: Vec<(String, Vec<u8>)>,
}

/// What [`CheckpointStorage::retain`] removed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GcReport {
    /// Complete checkpoints dropped beyond the retained count.
    pub dropped_checkpoints: Vec<u64>,
    /// Incomplete `chk-<n>` directories removed.
    pub removed_incomplete: Vec<u64>,
    /// Data files deleted (relative paths).
    pub deleted_files: Vec<PathBuf>,
}

/// Checkpoint storage of one job: `<root>/<job-id>/{chk-<n>/_metadata, shared/, taskowned/}`.
///
/// Cheap to clone and `Send + Sync`: the coordinator commits and collects garbage while the
/// shards' background threads write through [`CheckpointWriter`]s.
#[derive(Debug, Clone)]
pub struct CheckpointStorage {
    shared: Arc<Shared>,
}

impl CheckpointStorage {
    /// Open (creating the directories) the storage of `job_id` under `root`, with default
    /// options. Takes an exclusive lock on the job directory.
    pub fn open(
        fs: Arc<dyn Fs>,
        root: &Path,
        job_id: &str,
    ) -> Result<CheckpointStorage, CheckpointError> {
        Self::open_with(fs, root, job_id, StorageOptions::default())
    }

    /// [`open`](Self::open) with explicit options.
    pub fn open_with(
        fs: Arc<dyn Fs>,
        root: &Path,
        job_id: &str,
        options: StorageOptions,
    ) -> Result<CheckpointStorage, CheckpointError> {
        check_name("job id", job_id)?;
        if options.block_payload_bytes_max == 0 || options.physical_file_bytes_max == 0 {
            return Err(CheckpointError::InvalidArgument {
                what: "storage options",
                reason: "sizes must be positive".into(),
            });
        }
        let job_dir = root.join(job_id);
        for d in [SHARED_DIR, TASKOWNED_DIR] {
            create_dir_all_durable(&*fs, &job_dir.join(d))?;
        }
        fs.sync_dir(&job_dir)?;
        fs.sync_dir(root)?;
        let lock = DirLock::acquire(&job_dir)?;
        Self::build(fs, job_dir, job_id, options, false, Some(lock))
    }

    /// Open an existing job directory for listing, reading and verifying only (the `weir`
    /// tool while a job runs): no lock, no directory creation, no writes.
    pub fn open_read_only(
        fs: Arc<dyn Fs>,
        root: &Path,
        job_id: &str,
    ) -> Result<CheckpointStorage, CheckpointError> {
        Self::open_read_only_with(fs, root, job_id, StorageOptions::default())
    }

    /// [`open_read_only`](Self::open_read_only) with explicit options (of which reading uses
    /// [`StorageOptions::raw_diagnose`]).
    pub fn open_read_only_with(
        fs: Arc<dyn Fs>,
        root: &Path,
        job_id: &str,
        options: StorageOptions,
    ) -> Result<CheckpointStorage, CheckpointError> {
        check_name("job id", job_id)?;
        let job_dir = root.join(job_id);
        fs.list_dir(&job_dir)?;
        Self::build(fs, job_dir, job_id, options, true, None)
    }

    fn build(
        fs: Arc<dyn Fs>,
        job_dir: PathBuf,
        job_id: &str,
        options: StorageOptions,
        read_only: bool,
        dir_lock: Option<DirLock>,
    ) -> Result<CheckpointStorage, CheckpointError> {
        let storage = CheckpointStorage {
            shared: Arc::new(Shared {
                fs,
                job_id: job_id.to_owned(),
                job_dir,
                options,
                read_only,
                session: session_nonce(),
                next_file: AtomicU32::new(0),
                registry: Mutex::new(Registry::default()),
                gc: Mutex::new(()),
                _lock: dir_lock,
            }),
        };
        let latest = storage.latest_complete()?.map(|i| i.id);
        lock(&storage.shared.registry).latest_complete = latest;
        Ok(storage)
    }

    /// The job directory.
    pub fn job_dir(&self) -> &Path {
        &self.shared.job_dir
    }

    /// Start checkpoint `checkpoint_id`. Ids must grow: an id not above the newest complete
    /// checkpoint, or one already in progress, is refused.
    pub fn begin(&self, checkpoint_id: u64) -> Result<PendingCheckpoint, CheckpointError> {
        self.shared.writable("begin")?;
        let mut reg = lock(&self.shared.registry);
        if let Some(latest) = reg.latest_complete.filter(|&l| checkpoint_id <= l) {
            return Err(CheckpointError::StaleId {
                checkpoint_id,
                latest_complete: latest,
            });
        }
        if reg.in_progress.contains_key(&checkpoint_id) {
            return Err(CheckpointError::AlreadyInProgress { checkpoint_id });
        }
        reg.in_progress.insert(checkpoint_id, BTreeSet::new());
        drop(reg);
        Ok(PendingCheckpoint {
            inner: Arc::new(PendingInner {
                storage: self.shared.clone(),
                checkpoint_id,
                state: Mutex::new(PendingState::default()),
            }),
        })
    }

    /// Make checkpoint `pending` complete: check that every writer finished (each fsynced its
    /// files), that reused files still exist, fsync the data directories, then publish
    /// `chk-<n>/_metadata` (temp, fsync, rename, fsync directory). Any failure fails the
    /// checkpoint; its files become orphans for [`retain`](Self::retain) to delete.
    pub fn commit(
        &self,
        pending: PendingCheckpoint,
        info: CommitInfo,
    ) -> Result<CompletedCheckpoint, CheckpointError> {
        let sh = &self.shared;
        let id = pending.inner.checkpoint_id;
        let (files, logical_files, reused, new_bytes) = {
            let st = lock(&pending.inner.state);
            st.usable(id)?;
            if st.open_writers > 0 {
                return Err(CheckpointError::WritersNotFinished {
                    checkpoint_id: id,
                    open_writers: st.open_writers,
                });
            }
            let files: BTreeSet<FileRef> = st.files.iter().cloned().collect();
            let logical: BTreeSet<LogicalFileRef> = st.logical_files.iter().cloned().collect();
            (
                files.into_iter().collect::<Vec<_>>(),
                logical.into_iter().collect::<Vec<_>>(),
                st.reused.clone(),
                st.new_bytes,
            )
        };
        let metadata = CheckpointMetadata {
            job_id: sh.job_id.clone(),
            checkpoint_id: id,
            kind: CheckpointKind::Checkpoint,
            trigger_timestamp_ms: info.trigger_timestamp_ms,
            completion_timestamp_ms: info.completion_timestamp_ms,
            new_bytes,
            files,
            logical_files,
            sections: info.sections,
        };
        let bytes = metadata.encode();
        // Check what we are about to make durable (the pair of the check after reading it).
        let dir = sh.chk_dir(id);
        let path = dir.join(METADATA_FILE);
        assert_eq!(
            CheckpointMetadata::decode(&path, &bytes).as_ref(),
            Ok(&metadata),
            "metadata encoding does not round-trip"
        );
        let _gc = lock(&sh.gc);
        for rel in &reused {
            match sh.fs.open(&sh.job_dir.join(rel)) {
                Ok(_) => {}
                Err(e) if is_not_found(&e) => {
                    return Err(CheckpointError::MissingReusedFile {
                        checkpoint_id: id,
                        path: rel.clone(),
                    })
                }
                Err(e) => return Err(e.into()),
            }
        }
        let fail = |e: IoError| {
            lock(&pending.inner.state).failed = Some(e.to_string());
            e
        };
        // The directory entries of the new data files must be durable before the metadata
        // that names them.
        for d in [SHARED_DIR, TASKOWNED_DIR] {
            sh.fs.sync_dir(&sh.job_dir.join(d)).map_err(fail)?;
        }
        sh.fs.create_dir_all(&dir).map_err(fail)?;
        sh.fs.sync_dir(&sh.job_dir).map_err(fail)?;
        if let Err(e) = publish_file(&*sh.fs, &path, &bytes) {
            // Best effort: a failed publish must not look complete to this process. If the
            // rename happened and a crash later resurrects it, the checkpoint is still whole:
            // every file it names was durable before the rename.
            let _ = sh.fs.remove(&path);
            lock(&pending.inner.state).failed = Some(e.to_string());
            return Err(e.into());
        }
        let newest = {
            // An older checkpoint may complete after a newer one (concurrent checkpoints).
            let mut reg = lock(&sh.registry);
            reg.latest_complete = reg.latest_complete.max(Some(id));
            reg.latest_complete.unwrap_or(id)
        };
        // Best effort and not synced: see `completed_marker`. Written after the metadata is
        // durable, so it never names a checkpoint that did not complete; lost or stale after
        // a crash, it says less, never something false. (Under `_gc`: writes do not cross.)
        let _ = write_completed_marker(&*sh.fs, &sh.job_dir, newest);
        Ok(CompletedCheckpoint {
            metadata,
            metadata_path: path,
        })
    }

    /// Abort `pending`: its writers fail from now on, and the files it created are deleted.
    pub fn abort(&self, pending: PendingCheckpoint) -> Result<(), CheckpointError> {
        let written = {
            let mut st = lock(&pending.inner.state);
            st.aborted = true;
            std::mem::take(&mut st.written)
        };
        let sh = &self.shared;
        for rel in written {
            match sh.fs.remove(&sh.job_dir.join(&rel)) {
                Ok(()) => {}
                Err(e) if is_not_found(&e) => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }

    /// The bytes on disk of the files checkpoint `m` references (a checkpoint of this job),
    /// each physical file once: Flink's full checkpoint size, which counts what the state
    /// takes in storage, framing included, as the bytes a checkpoint wrote count it. The
    /// metadata's content sizes (`CheckpointMetadata::size_bytes`) left out the framing, so
    /// a full checkpoint's full size came out below the bytes it wrote. A file that cannot be
    /// opened counts its content size: this is a figure, not a check (`verify` is).
    pub fn stored_bytes(&self, m: &CheckpointMetadata) -> u64 {
        // A raw file is its content verbatim (most of a keyed state's bytes: its segments):
        // only framed and merged files are asked for their length, once per commit each.
        let mut raw = 0u64;
        let mut content: BTreeMap<&Path, u64> = BTreeMap::new();
        for f in &m.files {
            if f.is_raw() {
                raw = raw.saturating_add(f.size_bytes);
            } else {
                *content.entry(&f.path).or_default() += f.size_bytes;
            }
        }
        for l in &m.logical_files {
            *content.entry(&l.physical).or_default() += l.size_bytes;
        }
        let fs = &self.shared.fs;
        content
            .into_iter()
            .map(|(rel, size)| {
                fs.open(&self.shared.job_dir.join(rel))
                    .and_then(|f| f.len())
                    .unwrap_or(size)
            })
            .fold(raw, u64::saturating_add)
    }

    /// Every `chk-<n>` directory, by id; those without a valid `_metadata` are incomplete.
    pub fn list(&self) -> Result<Vec<CheckpointInfo>, CheckpointError> {
        Ok(self
            .scan()?
            .into_iter()
            .map(|(id, path, status)| match status {
                Status::Complete(m) => CheckpointInfo {
                    id,
                    path,
                    complete: true,
                    size_bytes: self.stored_bytes(&m),
                    new_bytes: m.new_bytes,
                    trigger_timestamp_ms: m.trigger_timestamp_ms,
                    completion_timestamp_ms: m.completion_timestamp_ms,
                    problem: None,
                    metadata_corrupt: false,
                },
                Status::Missing | Status::Corrupt(_) => CheckpointInfo {
                    id,
                    path,
                    complete: false,
                    metadata_corrupt: matches!(status, Status::Corrupt(_)),
                    size_bytes: 0,
                    new_bytes: 0,
                    trigger_timestamp_ms: 0,
                    completion_timestamp_ms: 0,
                    problem: Some(match status {
                        Status::Corrupt(e) => e,
                        _ => format!("no {METADATA_FILE}"),
                    }),
                },
            })
            .collect())
    }

    /// The id of the newest checkpoint this job directory is known to have completed (the
    /// `COMPLETED` file), if the file is there and readable. A lower bound: every checkpoint
    /// is recorded after its metadata is durable, retention never drops the newest complete
    /// checkpoint, and a crash may lose the newest record but not make it name a checkpoint
    /// that did not complete. So when no checkpoint at least this new has a `_metadata`, one
    /// was removed after it completed (its sinks may have committed), which a restore must
    /// not take for a checkpoint cut short by a crash. A record that does not decode says
    /// nothing here; [`Self::completed_record`] tells it from a missing one.
    pub fn completed_marker(&self) -> Option<u64> {
        self.completed_record().ok().flatten()
    }

    /// [`Self::completed_marker`], telling a missing record (`Ok(None)`: no checkpoint of
    /// this directory completed, or the file was removed) from one that does not decode
    /// (`Err`, naming the file and offset). Such a record was written (only a completed
    /// checkpoint writes one), but it may be damaged by a crash too: it is replaced without
    /// a sync, so a power cut can leave it empty or torn, while the checkpoint it names keeps
    /// its synced `_metadata`.
    pub fn completed_record(&self) -> Result<Option<u64>, CheckpointError> {
        let path = self.shared.job_dir.join(COMPLETED_FILE);
        let f = match self.shared.fs.open(&path) {
            Ok(f) => f,
            Err(e) if is_not_found(&e) => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        let len = usize::try_from(f.len()?).unwrap_or(usize::MAX).min(32);
        let mut buf = vec![0u8; len];
        f.read_at(0, &mut buf)?;
        let malformed = |offset: usize, reason: &str| {
            CheckpointError::Format(FormatError::Malformed {
                file: path.clone(),
                offset: offset as u64,
                reason: reason.to_string(),
            })
        };
        // "<id> <crc32 of the id's digits, 8 hex digits>\n".
        let Some(text) = std::str::from_utf8(&buf)
            .ok()
            .and_then(|t| t.strip_suffix('\n'))
        else {
            return Err(malformed(0, "not `<id> <crc>` and a newline"));
        };
        let Some((id, crc)) = text.split_once(' ') else {
            return Err(malformed(0, "no space between the id and its CRC"));
        };
        // Only as `write_completed_marker` spells it: `parse` alone would also take `04` or
        // `+4` (under their own CRC) for 4.
        let crc_at = id.len() + 1;
        if !is_lower_hex(crc, 8) {
            return Err(malformed(crc_at, "the CRC is not 8 lowercase hex digits"));
        }
        let (stored, computed) = (
            u32::from_str_radix(crc, 16).unwrap_or(0),
            crc32(&[id.as_bytes()]),
        );
        if stored != computed {
            return Err(CheckpointError::Format(FormatError::ChecksumMismatch {
                file: path,
                offset: crc_at as u64,
                expected: stored,
                actual: computed,
            }));
        }
        parse_id(id)
            .map(Some)
            .ok_or_else(|| malformed(0, "the id is not a checkpoint id in decimal"))
    }

    /// Durably record where a run starts (`RUN_ORIGIN`, replaced whole: temporary file,
    /// fsync, rename, directory fsync), before it takes any checkpoint. A later `latest`
    /// restore then continues that run: from a checkpoint it took, or else from where it
    /// started, never from a checkpoint of an earlier run it did not continue.
    pub fn record_run_origin(&self, origin: &RunOrigin) -> Result<(), CheckpointError> {
        if let Some((_, p)) = &origin.restored {
            if !p.is_absolute() || p.as_os_str().len() > RUN_ORIGIN_MAX_BYTES / 2 {
                return Err(CheckpointError::InvalidArgument {
                    what: "restored path",
                    reason: format!("{}: must be absolute and at most 4096 bytes", p.display()),
                });
            }
        }
        let path = self.shared.job_dir.join(RUN_ORIGIN_FILE);
        publish_file(
            &*self.shared.fs,
            &path,
            &origin.encode(&self.shared.job_dir),
        )?;
        Ok(())
    }

    /// Where the newest run of this job directory started ([`Self::record_run_origin`]):
    /// `Ok(None)` when no run recorded it (a directory of an older version, or none ran); an
    /// error naming the file and offset when the record does not decode. It is synced before
    /// the run begins, so a crash does not tear it.
    pub fn run_origin(&self) -> Result<Option<RunOrigin>, CheckpointError> {
        let path = self.shared.job_dir.join(RUN_ORIGIN_FILE);
        let f = match self.shared.fs.open(&path) {
            Ok(f) => f,
            Err(e) if is_not_found(&e) => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        let len = f.len()?;
        if len > RUN_ORIGIN_MAX_BYTES as u64 {
            return Err(CheckpointError::Format(FormatError::Malformed {
                file: path,
                offset: RUN_ORIGIN_MAX_BYTES as u64,
                reason: format!("{len} bytes; a record is at most {RUN_ORIGIN_MAX_BYTES}"),
            }));
        }
        let mut buf = vec![0u8; len as usize];
        f.read_at(0, &mut buf)?;
        RunOrigin::decode(&path, &self.shared.job_dir, &buf).map(Some)
    }

    /// The newest complete checkpoint.
    pub fn latest_complete(&self) -> Result<Option<CheckpointInfo>, CheckpointError> {
        Ok(self.list()?.into_iter().rev().find(|i| i.complete))
    }

    /// The verified metadata of complete checkpoint `checkpoint_id`.
    pub fn read_metadata(&self, checkpoint_id: u64) -> Result<CheckpointMetadata, CheckpointError> {
        let dir = self.shared.chk_dir(checkpoint_id);
        let m = read_metadata_file(&*self.shared.fs, &dir)?.ok_or_else(|| {
            CheckpointError::NotFound {
                checkpoint_id,
                path: dir.join(METADATA_FILE),
            }
        })?;
        self.check_identity(&dir, &m, checkpoint_id)?;
        Ok(m)
    }

    /// A metadata file with a valid CRC in the wrong place (copied, or of another job) is
    /// misdirected, not complete.
    fn check_identity(
        &self,
        dir: &Path,
        m: &CheckpointMetadata,
        checkpoint_id: u64,
    ) -> Result<(), CheckpointError> {
        let file = dir.join(METADATA_FILE);
        let wrong = |field, offset, expected: u64, found: u64| {
            CheckpointError::Format(crate::FormatError::Misdirected {
                file: file.clone(),
                offset,
                field,
                expected,
                found,
            })
        };
        if m.checkpoint_id != checkpoint_id {
            return Err(wrong("checkpoint id", 16, checkpoint_id, m.checkpoint_id));
        }
        if m.kind != CheckpointKind::Checkpoint {
            return Err(wrong("kind", 11, 1, 2));
        }
        if m.job_id != self.shared.job_id {
            return Err(CheckpointError::Format(crate::FormatError::Malformed {
                file,
                offset: 48,
                reason: format!(
                    "metadata of job {:?}, expected {:?}",
                    m.job_id, self.shared.job_id
                ),
            }));
        }
        Ok(())
    }

    /// Read a whole file of this job, verified (header, every block, content CRC).
    pub fn read_file(&self, r: &FileRef) -> Result<Vec<u8>, CheckpointError> {
        let sh = &self.shared;
        read_span(
            &*sh.fs,
            &sh.job_dir,
            &Span::of_file(r),
            sh.options.raw_diagnose,
        )
    }

    /// Copy the content of a whole file of this job to the new file `dest` (it must not exist),
    /// verified as [`read_file`](Self::read_file) verifies it (header, every block, content
    /// CRC), in one streaming pass that never holds the file in memory: restoring large state
    /// copies each segment once. A raw file is verified, then `dest` becomes a hard link to
    /// it (a copy where links fail): its reader must never write it. On error `dest` is
    /// removed and the error names the checkpoint file and offset. `dest` is not fsynced: it
    /// is a scratch copy that a crash discards.
    pub fn copy_file_to(&self, r: &FileRef, dest: &Path) -> Result<u64, CheckpointError> {
        let sh = &self.shared;
        let diagnose = sh.options.raw_diagnose;
        copy_span_to(&*sh.fs, &sh.job_dir, &Span::of_file(r), diagnose, dest)
    }

    /// Give the new file `dest` (it must not exist) the content of a whole file of this job.
    /// A raw file becomes a hard link once its length is checked, *without reading it*; a
    /// framed one (or a raw one where links fail) is copied as by
    /// [`copy_file_to`](Self::copy_file_to), verified. Only for a caller that verified the
    /// checkpoint ([`verify`](Self::verify)) and whose reader of `dest` checks every byte it
    /// uses against the file's size and CRC (a store opening a segment: every block, then
    /// size and whole-file CRC against its handle). Returns the content length.
    pub fn link_file_to(&self, r: &FileRef, dest: &Path) -> Result<u64, CheckpointError> {
        let sh = &self.shared;
        let diagnose = sh.options.raw_diagnose;
        link_span_to(&*sh.fs, &sh.job_dir, &Span::of_file(r), diagnose, dest)
    }

    /// Read a logical file of this job, verified.
    pub fn read_logical(&self, r: &LogicalFileRef) -> Result<Vec<u8>, CheckpointError> {
        let sh = &self.shared;
        read_span(
            &*sh.fs,
            &sh.job_dir,
            &Span::of_logical(r),
            sh.options.raw_diagnose,
        )
    }

    /// Check the metadata and every CRC of every file checkpoint `checkpoint_id` uses.
    pub fn verify(&self, checkpoint_id: u64) -> Result<VerifyReport, VerifyError> {
        let dir = self.shared.chk_dir(checkpoint_id);
        let m = self
            .read_metadata(checkpoint_id)
            .map_err(|e| VerifyError::from_read(checkpoint_id, &dir, e))?;
        let sh = &self.shared;
        verify_files(&*sh.fs, &sh.job_dir, &m, sh.options.raw_diagnose)
    }

    fn scan(&self) -> Result<Vec<(u64, PathBuf, Status)>, CheckpointError> {
        let mut out = Vec::new();
        for path in self.shared.fs.list_dir(&self.shared.job_dir)? {
            // Only `chk-<n>` as `chk_dir` spells it: another spelling of an id (`chk-04`) is
            // not ours, and is neither listed nor removed.
            let Some(id) = path
                .file_name()
                .and_then(|n| n.to_str())
                .and_then(parse_checkpoint_dir_name)
            else {
                continue;
            };
            let status = match self.read_metadata(id) {
                Ok(m) => Status::Complete(Box::new(m)),
                Err(CheckpointError::NotFound { .. }) => Status::Missing,
                Err(CheckpointError::Format(e)) => Status::Corrupt(e.to_string()),
                Err(e) => return Err(e),
            };
            out.push((id, path, status));
        }
        out.sort_by_key(|(id, _, _)| *id);
        Ok(out)
    }

    /// Keep the newest `keep` complete checkpoints, drop the others (metadata first, durably),
    /// remove incomplete directories older than the newest complete checkpoint, and delete
    /// every data file that nothing refers to (see the module docs for the exact rule).
    pub fn retain(&self, keep: usize) -> Result<GcReport, CheckpointError> {
        let sh = &self.shared;
        sh.writable("retain")?;
        if keep == 0 {
            return Err(CheckpointError::InvalidArgument {
                what: "retained checkpoint count",
                reason: "must be at least 1".into(),
            });
        }
        let _gc = lock(&sh.gc);
        let (in_progress_ids, mut referenced, mut pinned) = {
            let reg = lock(&sh.registry);
            let ids: BTreeSet<u64> = reg.in_progress.keys().copied().collect();
            let paths: BTreeSet<PathBuf> = reg.in_progress.values().flatten().cloned().collect();
            let pinned: BTreeSet<u64> = reg.pinned.keys().copied().collect();
            (ids, paths, pinned)
        };
        let scan = self.scan()?;
        // The checkpoint of this directory that its last run restored, while that run has no
        // complete checkpoint of its own: a restore from `latest` goes back to it (see
        // `record_run_origin`), so retention (`weir checkpoints clean` between a kill and the
        // restart) keeps it.
        if let Ok(Some(RunOrigin {
            first_id,
            restored: Some((id, path)),
        })) = self.run_origin()
        {
            let own = path.parent().map(crate::fs::resolved_path)
                == Some(crate::fs::resolved_path(&sh.job_dir))
                && path.file_name().and_then(|n| n.to_str()) == Some(&checkpoint_dir_name(id));
            let continued = scan
                .iter()
                .any(|(n, _, s)| *n >= first_id && matches!(s, Status::Complete(_)));
            if own && !continued {
                pinned.insert(id);
            }
        }
        let complete: Vec<(u64, &PathBuf, &CheckpointMetadata)> = scan
            .iter()
            .filter_map(|(id, p, s)| match s {
                Status::Complete(m) => Some((*id, p, &**m)),
                _ => None,
            })
            .collect();
        let mut report = GcReport::default();
        let Some(newest) = complete.last().map(|c| c.0) else {
            return Ok(report);
        };
        let split = complete.len().saturating_sub(keep);
        for (id, _, m) in &complete {
            if *id >= complete[split].0 || pinned.contains(id) {
                referenced.extend(m.physical_paths());
            }
        }
        for &(id, dir, _) in &complete[..split] {
            if pinned.contains(&id) {
                continue;
            }
            sh.fs.remove(&dir.join(METADATA_FILE))?;
            // The removal must be durable before any file it referenced goes.
            sh.fs.sync_dir(dir)?;
            remove_dir_contents(&*sh.fs, dir)?;
            report.dropped_checkpoints.push(id);
        }
        for (id, dir, status) in &scan {
            if matches!(status, Status::Missing) && *id < newest && !in_progress_ids.contains(id) {
                remove_dir_contents(&*sh.fs, dir)?;
                report.removed_incomplete.push(*id);
            }
        }
        sh.fs.sync_dir(&sh.job_dir)?;
        for d in [SHARED_DIR, TASKOWNED_DIR] {
            let dir = sh.job_dir.join(d);
            for path in sh.fs.list_dir(&dir)? {
                let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
                    continue;
                };
                let Some((creator, _)) = parse_data_file_name(name) else {
                    continue;
                };
                let rel = Path::new(d).join(name);
                if creator > newest
                    || in_progress_ids.contains(&creator)
                    || referenced.contains(&rel)
                {
                    continue;
                }
                match sh.fs.remove(&path) {
                    Ok(()) => report.deleted_files.push(rel),
                    Err(e) if is_not_found(&e) => {}
                    Err(e) => return Err(e.into()),
                }
            }
            sh.fs.sync_dir(&dir)?;
        }
        Ok(report)
    }

    /// Hold complete checkpoint `checkpoint_id` against retention until the pin is dropped
    /// (a savepoint being copied out of it, say). Fails if it is not complete.
    pub fn pin(&self, checkpoint_id: u64) -> Result<CheckpointPin, CheckpointError> {
        // Under the GC lock: no retain can drop the checkpoint between the check and the pin.
        let _gc = lock(&self.shared.gc);
        self.read_metadata(checkpoint_id)?;
        *lock(&self.shared.registry)
            .pinned
            .entry(checkpoint_id)
            .or_default() += 1;
        Ok(CheckpointPin {
            storage: self.clone(),
            checkpoint_id,
        })
    }

    /// Export complete checkpoint `checkpoint_id` as a self-contained savepoint in
    /// `<savepoint_root>/<name>`: every file it needs is copied under the same relative path,
    /// verified, made durable, and the metadata (kind savepoint) is published last.
    pub fn export_savepoint(
        &self,
        checkpoint_id: u64,
        savepoint_root: &Path,
        name: &str,
    ) -> Result<PathBuf, CheckpointError> {
        check_name("savepoint name", name)?;
        let sh = &self.shared;
        let target = savepoint_root.join(name);
        // Retention removes checkpoint directories whole, and `clean` what no checkpoint uses:
        // a savepoint among them would be deleted, or stop the removal of a checkpoint.
        if crate::fs::resolved_path(&target).starts_with(crate::fs::resolved_path(&sh.job_dir)) {
            return Err(CheckpointError::InvalidArgument {
                what: "savepoint directory",
                reason: format!(
                    "{} is in the job's checkpoint directory {}, where retention deletes \
                     checkpoints with what is in them",
                    savepoint_root.display(),
                    sh.job_dir.display()
                ),
            });
        }
        if target.exists() {
            return Err(CheckpointError::AlreadyExists { path: target });
        }
        self.verify(checkpoint_id)?;
        let mut metadata = self.read_metadata(checkpoint_id)?;
        metadata.kind = CheckpointKind::Savepoint;
        let staging = target.join(SAVEPOINT_STAGING_DIR);
        let copied = (|| -> Result<(), CheckpointError> {
            for d in [SHARED_DIR, TASKOWNED_DIR] {
                create_dir_all_durable(&*sh.fs, &target.join(d))?;
            }
            // First a hard link to every file, where the file system takes them: files are
            // immutable once uploaded, so the links hold the checkpoint's files at once, and a
            // running job's retention can no longer drop them from under a tool exporting
            // the checkpoint (a copy takes longer than a 10 ms interval). The savepoint then
            // gets copies of its own (not links: an independent copy, which no damage to the
            // job's files reaches), and the links go.
            let paths = metadata.physical_paths();
            let mut sources = Vec::with_capacity(paths.len());
            for rel in &paths {
                let (from, held) = (sh.job_dir.join(rel), staging.join(rel));
                let linked = held
                    .parent()
                    .is_some_and(|d| sh.fs.create_dir_all(d).is_ok())
                    && sh.fs.hard_link(&from, &held).is_ok();
                sources.push(if linked { held } else { from });
            }
            for (rel, from) in paths.iter().zip(&sources) {
                copy_file(&*sh.fs, from, &target.join(rel))?;
            }
            remove_staging(&*sh.fs, &staging)?;
            // The copies are verbatim: check them before the metadata makes them a savepoint.
            verify_files(&*sh.fs, &target, &metadata, sh.options.raw_diagnose)?;
            for d in [SHARED_DIR, TASKOWNED_DIR] {
                sh.fs.sync_dir(&target.join(d))?;
            }
            sh.fs.sync_dir(&target)?;
            sh.fs.sync_dir(savepoint_root)?;
            publish_file(&*sh.fs, &target.join(METADATA_FILE), &metadata.encode())?;
            Ok(())
        })();
        if let Err(e) = copied {
            // A checkpoint dropped by its job's retention while it was copied (a tool beside a
            // running job), or a failed copy or metadata write: the directory goes, so that
            // none is left that is not a whole savepoint. Best effort; one a crash leaves has
            // no `_metadata` (published last), so it is no savepoint.
            let _ = remove_staging(&*sh.fs, &staging);
            for d in [SHARED_DIR, TASKOWNED_DIR] {
                let _ = remove_dir_contents(&*sh.fs, &target.join(d));
            }
            let _ = remove_dir_contents(&*sh.fs, &target);
            return Err(e);
        }
        Ok(target)
    }
}

/// A fresh directory name for a savepoint of checkpoint `checkpoint_id`:
/// `savepoint-<id>-<12 hex digits of the clock>`, distinct for calls of one process.
/// [`CheckpointStorage::export_savepoint`] refuses a name that exists.
pub fn savepoint_dir_name(checkpoint_id: u64) -> String {
    static CALLS: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let n = nanos.wrapping_add(CALLS.fetch_add(1, Ordering::Relaxed)) & 0xffff_ffff_ffff;
    format!("savepoint-{checkpoint_id}-{n:012x}")
}

/// A complete checkpoint that [`CheckpointStorage::retain`] keeps while this lives, whatever
/// the retained count.
#[derive(Debug)]
pub struct CheckpointPin {
    storage: CheckpointStorage,
    checkpoint_id: u64,
}

impl CheckpointPin {
    pub fn checkpoint_id(&self) -> u64 {
        self.checkpoint_id
    }

    /// [`CheckpointStorage::export_savepoint`] of the pinned checkpoint.
    pub fn export_savepoint(
        &self,
        savepoint_root: &Path,
        name: &str,
    ) -> Result<PathBuf, CheckpointError> {
        self.storage
            .export_savepoint(self.checkpoint_id, savepoint_root, name)
    }
}

impl Drop for CheckpointPin {
    fn drop(&mut self) {
        let mut reg = lock(&self.storage.shared.registry);
        if let Some(n) = reg.pinned.get_mut(&self.checkpoint_id) {
            *n -= 1;
            if *n == 0 {
                reg.pinned.remove(&self.checkpoint_id);
            }
        }
    }
}

enum Status {
    Complete(Box<CheckpointMetadata>),
    Missing,
    Corrupt(String),
}

/// Where [`CheckpointStorage::export_savepoint`] holds hard links to a checkpoint's files
/// while it copies them, inside the savepoint's directory (hidden; gone before the metadata
/// makes the directory a savepoint).
const SAVEPOINT_STAGING_DIR: &str = ".links";

/// Remove a savepoint's staging links (see [`SAVEPOINT_STAGING_DIR`]), those there are.
fn remove_staging(fs: &dyn Fs, staging: &Path) -> Result<(), CheckpointError> {
    for d in [
        staging.join(SHARED_DIR),
        staging.join(TASKOWNED_DIR),
        staging.to_owned(),
    ] {
        match remove_dir_contents(fs, &d) {
            Err(CheckpointError::Io(e)) if is_not_found(&e) => {}
            r => r?,
        }
    }
    Ok(())
}

/// Remove the files in `dir` and then `dir` itself.
fn remove_dir_contents(fs: &dyn Fs, dir: &Path) -> Result<(), CheckpointError> {
    for p in fs.list_dir(dir)? {
        fs.remove(&p)?;
    }
    // An empty directory left behind by a crash here is listed as incomplete and removed by
    // the next `retain`.
    fs.remove_dir(dir)?;
    Ok(())
}

fn copy_file(fs: &dyn Fs, from: &Path, to: &Path) -> Result<(), CheckpointError> {
    let src = fs.open(from)?;
    let len = src.len()?;
    let mut dst = fs.create(to)?;
    let mut buf = vec![0u8; COPY_CHUNK_BYTES.min(len as usize)];
    let mut at = 0u64;
    while at < len {
        let n = ((len - at) as usize).min(buf.len());
        src.read_at(at, &mut buf[..n])?;
        dst.write_at(at, &buf[..n])?;
        at += n as u64;
    }
    dst.sync()?;
    Ok(())
}

#[derive(Debug, Default)]
struct PendingState {
    /// Data files created (relative paths), for abort.
    written: Vec<PathBuf>,
    /// Files reused from earlier checkpoints (relative paths), checked at commit.
    reused: Vec<PathBuf>,
    files: Vec<FileRef>,
    logical_files: Vec<LogicalFileRef>,
    new_bytes: u64,
    open_writers: usize,
    aborted: bool,
    failed: Option<String>,
}

impl PendingState {
    fn usable(&self, checkpoint_id: u64) -> Result<(), CheckpointError> {
        if self.aborted {
            return Err(CheckpointError::Aborted { checkpoint_id });
        }
        if let Some(reason) = &self.failed {
            return Err(CheckpointError::Failed {
                checkpoint_id,
                reason: reason.clone(),
            });
        }
        Ok(())
    }
}

#[derive(Debug)]
struct PendingInner {
    storage: Arc<Shared>,
    checkpoint_id: u64,
    state: Mutex<PendingState>,
}

impl Drop for PendingInner {
    fn drop(&mut self) {
        // Committed, aborted or abandoned: GC may judge its files from now on.
        lock(&self.storage.registry)
            .in_progress
            .remove(&self.checkpoint_id);
    }
}

impl PendingInner {
    /// Register a path before creating (or reusing) it, so GC never sees it unregistered.
    fn register(&self, rel: &Path, created: bool) -> Result<(), CheckpointError> {
        let mut st = lock(&self.state);
        st.usable(self.checkpoint_id)?;
        lock(&self.storage.registry)
            .in_progress
            .entry(self.checkpoint_id)
            .or_default()
            .insert(rel.to_owned());
        if created {
            st.written.push(rel.to_owned());
        } else {
            st.reused.push(rel.to_owned());
        }
        Ok(())
    }

    fn fail<E: std::fmt::Display>(&self, e: E) -> E {
        let mut st = lock(&self.state);
        if st.failed.is_none() {
            st.failed = Some(e.to_string());
        }
        e
    }
}

/// A checkpoint being written. Hand one [`CheckpointWriter`] to each shard's background thread
/// ([`writer`](Self::writer)); then [`CheckpointStorage::commit`] or
/// [`CheckpointStorage::abort`] it. `Send + Sync`.
#[derive(Debug)]
pub struct PendingCheckpoint {
    inner: Arc<PendingInner>,
}

impl PendingCheckpoint {
    /// The checkpoint id.
    pub fn checkpoint_id(&self) -> u64 {
        self.inner.checkpoint_id
    }

    /// A new writer with its own merged physical files. Each writer must be
    /// [`finish`](CheckpointWriter::finish)ed before commit.
    pub fn writer(&self) -> CheckpointWriter {
        lock(&self.inner.state).open_writers += 1;
        CheckpointWriter {
            inner: self.inner.clone(),
            physical: [None, None],
            unsynced: Vec::new(),
            finished: false,
        }
    }
}

#[derive(Debug)]
struct Physical {
    file: Box<dyn FsFile>,
    rel: PathBuf,
    file_id: u64,
    end: u64,
    next_block: u32,
}

/// Writes the files of one shard for one checkpoint. Owned by one thread (`Send`); several
/// writers of one checkpoint work in parallel, each with its own physical files.
#[derive(Debug)]
pub struct CheckpointWriter {
    inner: Arc<PendingInner>,
    /// Current merged physical file per [`SmallFileKind`] (task-owned, shared).
    physical: [Option<Physical>; 2],
    /// Files written and not yet fsynced (rolled physical files, uploads).
    unsynced: Vec<Box<dyn FsFile>>,
    finished: bool,
}

/// What a writer wrote.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct WriterStats {
    pub files_synced: usize,
}

/// A file uploaded with its writer's size (`expected`) must have it.
fn check_known_size(src: &Path, expected: u64, size: u64) -> Result<(), CheckpointError> {
    if size != expected {
        return Err(FormatError::Malformed {
            file: src.to_owned(),
            offset: size.min(expected),
            reason: format!("{size} bytes where its writer wrote {expected}"),
        }
        .into());
    }
    Ok(())
}

impl CheckpointWriter {
    /// Put the immutable local file `src` (an LSM segment) into `shared/` and return its
    /// reference. Not yet durable: see [`finish`](Self::finish).
    ///
    /// With [`StorageOptions::link_uploads`] (the default) the file becomes a *raw file*: a
    /// hard link to `src` under a `raw-` name, its length and content CRC in the reference,
    /// no bytes copied. Why: a checkpoint uploads each new segment once, and the copy (read,
    /// frame, write through the page cache, fsync) was most of a checkpoint's background
    /// work; a restore copied each segment back again. `src` must never be written again,
    /// which segments never are. Where the link fails (another file system) or with the option
    /// off, the file is copied, framed in checksummed blocks.
    pub fn upload_shared(
        &mut self,
        src: &Path,
        name_hint: &str,
    ) -> Result<FileRef, CheckpointError> {
        let r = self.upload_inner(src, name_hint, None, true);
        r.map_err(|e| self.inner.fail(e))
    }

    /// [`upload_shared`](Self::upload_shared) of a file whose size and whole-file CRC-32 its
    /// writer computed from the bytes it wrote (a segment's). A raw file takes them as they
    /// are, checking only the size, instead of reading the file for its CRC: a segment's pieces
    /// bypass the page cache, so that read came from the device, and a checkpoint listing a
    /// gigabyte of segments spent seconds in it. The writer's CRC is also the better one to
    /// record: a file that no longer holds what was written fails its restore instead of
    /// having its new bytes vouched for. A copy compares the CRC of what it copied.
    pub fn upload_shared_known(
        &mut self,
        src: &Path,
        name_hint: &str,
        size_bytes: u64,
        crc32: u32,
    ) -> Result<FileRef, CheckpointError> {
        let r = self.upload_inner(src, name_hint, Some((size_bytes, crc32)), true);
        r.map_err(|e| self.inner.fail(e))
    }

    /// [`upload_shared_known`](Self::upload_shared_known), always as a copy (framed), never a
    /// link: for a full checkpoint, which must share no bytes with another. A link of the
    /// same local segment in two checkpoints is one inode under two names, so damage to one
    /// was damage to both.
    pub fn copy_shared_known(
        &mut self,
        src: &Path,
        name_hint: &str,
        size_bytes: u64,
        crc32: u32,
    ) -> Result<FileRef, CheckpointError> {
        let r = self.upload_inner(src, name_hint, Some((size_bytes, crc32)), false);
        r.map_err(|e| self.inner.fail(e))
    }

    fn upload_inner(
        &mut self,
        src: &Path,
        name_hint: &str,
        known: Option<(u64, u32)>,
        link: bool,
    ) -> Result<FileRef, CheckpointError> {
        let sh = self.inner.storage.clone();
        if link && sh.options.link_uploads {
            if let Some(r) = self.link_raw(&sh, src, &sanitize_hint(name_hint), known)? {
                return Ok(r);
            }
        }
        let source = sh.fs.map_readonly(src)?;
        let mut p =
            self.create_physical(FILE_KIND_UPLOAD, SHARED_DIR, &sanitize_hint(name_hint))?;
        let (_, _, crc) = Self::append(&mut p, &source, sh.options.block_payload_bytes_max)?;
        if let Some((size, expected)) = known {
            check_known_size(src, size, source.len() as u64)?;
            if crc != expected {
                return Err(FormatError::ChecksumMismatch {
                    file: src.to_owned(),
                    offset: 0,
                    expected,
                    actual: crc,
                }
                .into());
            }
        }
        let r = FileRef {
            path: p.rel.clone(),
            size_bytes: source.len() as u64,
            crc32: crc,
        };
        // The header was counted when the file was created.
        let written = p.end - DATA_HEADER_LEN as u64;
        self.unsynced.push(p.file);
        let mut st = lock(&self.inner.state);
        st.new_bytes += written;
        st.files.push(r.clone());
        Ok(r)
    }

    /// [`upload_shared`](Self::upload_shared) as a raw file: `None` if the file system refused
    /// the link (the caller copies instead).
    fn link_raw(
        &mut self,
        sh: &Arc<Shared>,
        src: &Path,
        hint: &str,
        known: Option<(u64, u32)>,
    ) -> Result<Option<FileRef>, CheckpointError> {
        let (size_bytes, crc) = match known {
            Some((size, crc)) => {
                check_known_size(src, size, sh.fs.open(src)?.len()?)?;
                (size, crc)
            }
            None => {
                let source = sh.fs.map_readonly(src)?;
                (source.len() as u64, crc32(&[&source]))
            }
        };
        let rel = Path::new(SHARED_DIR).join(raw_file_name(
            self.inner.checkpoint_id,
            sh.next_file_id(),
            hint,
        ));
        // Registered before it exists, as every created file; an abort ignores it if the link
        // below fails.
        self.inner.register(&rel, true)?;
        let dst = sh.job_dir.join(&rel);
        if let Err(e) = sh.fs.hard_link(src, &dst) {
            tracing::debug!("linking {} failed, copying it: {e}", src.display());
            return Ok(None);
        }
        // The source's writer synced it (a store syncs a segment before listing it); `finish`
        // syncs it again, which costs nothing then and holds even for a careless caller.
        self.unsynced.push(sh.fs.open(&dst)?);
        let r = FileRef {
            path: rel,
            size_bytes,
            crc32: crc,
        };
        let mut st = lock(&self.inner.state);
        st.new_bytes += size_bytes;
        st.files.push(r.clone());
        Ok(Some(r))
    }

    /// Reference a whole file uploaded by an earlier, still retained checkpoint instead of
    /// uploading it again (incremental checkpoints). A file already gone is
    /// [`CheckpointError::MissingReusedFile`] (upload it instead); one that exists is held
    /// against retention from here on. Checked and registered under the GC lock: a retention
    /// between the check and the registration (checkpoints running concurrently, one
    /// completing while another decides what to reuse) deleted the file, and the commit failed.
    pub fn reuse_shared(&mut self, r: &FileRef) -> Result<(), CheckpointError> {
        self.check_reuse(&r.path)?;
        let sh = &self.inner.storage;
        let _gc = lock(&sh.gc);
        match sh.fs.open(&sh.job_dir.join(&r.path)) {
            Ok(_) => {}
            Err(e) if is_not_found(&e) => {
                return Err(CheckpointError::MissingReusedFile {
                    checkpoint_id: self.inner.checkpoint_id,
                    path: r.path.clone(),
                })
            }
            Err(e) => return Err(self.inner.fail(e).into()),
        }
        self.inner.register(&r.path, false)?;
        lock(&self.inner.state).files.push(r.clone());
        Ok(())
    }

    /// Reference a logical file in a shared merged file of an earlier, retained checkpoint.
    pub fn reuse_logical(&mut self, r: &LogicalFileRef) -> Result<(), CheckpointError> {
        self.check_reuse(&r.physical)?;
        if !r.physical.starts_with(SHARED_DIR) {
            return Err(CheckpointError::InvalidArgument {
                what: "reused logical file",
                reason: format!("{} is task-owned, not shared", r.physical.display()),
            });
        }
        self.inner.register(&r.physical, false)?;
        lock(&self.inner.state).logical_files.push(r.clone());
        Ok(())
    }

    fn check_reuse(&self, rel: &Path) -> Result<(), CheckpointError> {
        if !crate::checkpoint::format::is_safe_relative(rel) {
            return Err(CheckpointError::InvalidArgument {
                what: "reused file",
                reason: format!("{} is not a relative path", rel.display()),
            });
        }
        Ok(())
    }

    /// Append `bytes` as a logical file to this writer's current merged physical file of
    /// `kind` (rolling to a new one at the size limit). Not yet durable: see
    /// [`finish`](Self::finish).
    pub fn write_small(
        &mut self,
        bytes: &[u8],
        kind: SmallFileKind,
    ) -> Result<LogicalFileRef, CheckpointError> {
        let r = self.write_small_inner(bytes, kind);
        r.map_err(|e| self.inner.fail(e))
    }

    fn write_small_inner(
        &mut self,
        bytes: &[u8],
        kind: SmallFileKind,
    ) -> Result<LogicalFileRef, CheckpointError> {
        let opts = self.inner.storage.options;
        let (slot, file_kind, dir) = match kind {
            SmallFileKind::TaskOwned => (0, FILE_KIND_MERGED_TASKOWNED, TASKOWNED_DIR),
            SmallFileKind::Shared => (1, FILE_KIND_MERGED_SHARED, SHARED_DIR),
        };
        let framed =
            crate::checkpoint::format::framed_len(bytes.len() as u64, opts.block_payload_bytes_max);
        let roll = self.physical[slot].as_ref().is_some_and(|p| {
            p.end > DATA_HEADER_LEN as u64 && p.end + framed > opts.physical_file_bytes_max
        });
        if roll {
            if let Some(p) = self.physical[slot].take() {
                self.unsynced.push(p.file);
            }
        }
        if self.physical[slot].is_none() {
            self.physical[slot] = Some(self.create_physical(file_kind, dir, "merged")?);
        }
        let Some(p) = self.physical[slot].as_mut() else {
            unreachable!("physical file was just created")
        };
        let before = p.end;
        let (offset, first_block, crc) = Self::append(p, bytes, opts.block_payload_bytes_max)?;
        let r = LogicalFileRef {
            physical: p.rel.clone(),
            offset,
            size_bytes: bytes.len() as u64,
            first_block,
            crc32: crc,
        };
        let written = p.end - before;
        let mut st = lock(&self.inner.state);
        st.new_bytes += written;
        st.logical_files.push(r.clone());
        Ok(r)
    }

    fn create_physical(
        &mut self,
        file_kind: u8,
        dir: &str,
        hint: &str,
    ) -> Result<Physical, CheckpointError> {
        let sh = &self.inner.storage;
        let file_id = sh.next_file_id();
        let rel = Path::new(dir).join(data_file_name(self.inner.checkpoint_id, file_id, hint));
        self.inner.register(&rel, true)?;
        let mut file = sh.fs.create(&sh.job_dir.join(&rel))?;
        let header = DataHeader {
            file_kind,
            block_payload_bytes_max: sh.options.block_payload_bytes_max,
            file_id,
            checkpoint_id: self.inner.checkpoint_id,
        };
        file.write_at(0, &header.encode())?;
        lock(&self.inner.state).new_bytes += DATA_HEADER_LEN as u64;
        Ok(Physical {
            file,
            rel,
            file_id,
            end: DATA_HEADER_LEN as u64,
            next_block: 0,
        })
    }

    /// Frame `bytes` in blocks at the end of `p`. Returns (offset, first block, content CRC).
    fn append(
        p: &mut Physical,
        bytes: &[u8],
        block_max: u32,
    ) -> Result<(u64, u32, u32), CheckpointError> {
        let offset = p.end;
        let first_block = p.next_block;
        let mut buf = Vec::with_capacity(COPY_CHUNK_BYTES.min(bytes.len() + 64));
        let mut chunks: Vec<&[u8]> = bytes.chunks(block_max as usize).collect();
        if chunks.is_empty() {
            chunks.push(&[]);
        }
        for chunk in chunks {
            let header = BlockHeader {
                file_id: p.file_id,
                block_index: p.next_block,
                kind: DATA_BLOCK_KIND,
                payload_len: chunk.len() as u32,
            };
            encode_block(&mut buf, header, chunk);
            p.next_block =
                p.next_block
                    .checked_add(1)
                    .ok_or_else(|| CheckpointError::InvalidArgument {
                        what: "physical file",
                        reason: "more than u32::MAX blocks".into(),
                    })?;
            if buf.len() >= COPY_CHUNK_BYTES {
                p.file.write_at(p.end, &buf)?;
                p.end += buf.len() as u64;
                buf.clear();
            }
        }
        if !buf.is_empty() {
            p.file.write_at(p.end, &buf)?;
            p.end += buf.len() as u64;
        }
        Ok((offset, first_block, crc32(&[bytes])))
    }

    /// fsync every file this writer wrote (on the calling thread, so shards sync in
    /// parallel) and hand them to the checkpoint. A failed fsync fails the checkpoint: the
    /// data may be gone and retrying would prove nothing.
    pub fn finish(mut self) -> Result<WriterStats, CheckpointError> {
        let r = self.finish_inner();
        self.finished = true;
        let mut st = lock(&self.inner.state);
        st.open_writers -= 1;
        if let Err(e) = &r {
            if st.failed.is_none() {
                st.failed = Some(e.to_string());
            }
        }
        r
    }

    fn finish_inner(&mut self) -> Result<WriterStats, CheckpointError> {
        lock(&self.inner.state).usable(self.inner.checkpoint_id)?;
        let mut files = std::mem::take(&mut self.unsynced);
        files.extend(
            self.physical
                .iter_mut()
                .filter_map(|p| p.take())
                .map(|p| p.file),
        );
        for f in &mut files {
            f.sync()?;
        }
        Ok(WriterStats {
            files_synced: files.len(),
        })
    }
}

impl Drop for CheckpointWriter {
    fn drop(&mut self) {
        if !self.finished {
            let mut st = lock(&self.inner.state);
            st.open_writers -= 1;
            if st.failed.is_none() {
                st.failed = Some("a writer was dropped without finish".into());
            }
        }
    }
}
