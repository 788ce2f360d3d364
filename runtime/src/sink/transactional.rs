//! An exactly-once file sink: two-phase commit over hidden part files, as Flink's FileSink
//! does it. The protocol (file names, states, the pre-commit description format and what
//! happens at each crash point) is documented in `docs/file-sink.md`.
//!
//! Per shard `s` the writer appends lines to a hidden in-progress file
//! `.part-<s>-<seq>.inprogress`. At checkpoint `n`'s barrier it fsyncs it and renames it to the
//! still hidden `.part-<s>-<seq>.pending-<n>`; when checkpoint `n` is complete it renames it to
//! the visible `part-<s>-<seq>.csv`. Readers only ever see complete files, renamed atomically.

use std::collections::{BTreeMap, HashSet};
use std::fmt::Display;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, Weak};

use weir_io::{crc32, DirLock, Fs, FsFile, IoError, StdFs, CHECKSUM_CRC32_IEEE};

use super::{Sink, SinkWriter};
use crate::error::StartError;

/// The lock file a [`TransactionalFileSink`] holds in its output directory while its writers
/// exist (hidden, so readers of the directory skip it). A restore deletes hidden files of its
/// shard indices that no checkpoint lists, which would be another job's files in progress: one
/// job per output directory.
pub const SINK_LOCK_FILE: &str = ".weir-sink.lock";

/// Default size past which a part file is closed and a new one started: 128 MiB.
pub const DEFAULT_PART_SIZE_BYTES: u64 = 128 << 20;

/// Write buffer size: one system call per 64 KiB of output rather than per line.
const WRITE_BUFFER_BYTES: usize = 64 * 1024;

/// Magic of a pre-commit description ("weir transactional sink").
const STATE_MAGIC: [u8; 4] = *b"WTXS";
/// Version of the pre-commit description format written (version 1 is still read).
const STATE_VERSION: u8 = 3;
/// Bytes of the fixed header (version 2 follows it with the directory).
const STATE_HEADER_LEN: usize = 32;
/// Bytes of the trailing CRC.
const STATE_TRAILER_LEN: usize = 4;
/// Smallest possible entry (two one-byte names), used to bound the entry count before
/// allocating.
const STATE_MIN_ENTRY_LEN: usize = 8 + 8 + 8 + 4 + 2 + 1 + 2 + 1;

/// An exactly-once file sink: one line per record, in part files that become visible only when
/// the checkpoint that covers them is complete (or, without checkpointing, when input ends).
///
/// Per shard `s`, lines go to a hidden `.part-<s>-<seq>.inprogress` file; checkpoint `n`'s
/// pre-commit fsyncs it and renames it to the hidden `.part-<s>-<seq>.pending-<n>`; the commit
/// of `n` renames it to the visible `part-<s>-<seq>.csv`. `docs/file-sink.md` describes the
/// protocol, the crash cases and the pre-commit description format.
pub struct TransactionalFileSink<F> {
    dir: PathBuf,
    format: Arc<F>,
    part_size: u64,
    fs: Arc<dyn Fs>,
    /// The output directory's lock ([`SINK_LOCK_FILE`]), shared by the writers this sink made:
    /// held while any of them exists, and by the sink itself (`kept`) until it is dropped.
    lock: Mutex<Weak<DirLock>>,
    /// The same lock, held by the sink itself from its first writer (or [`Self::with_lock`])
    /// until the sink goes with its job: a restart's writers are made after the failed
    /// attempt's are dropped, and without this the directory was unlocked in between (another
    /// job took it during a restart's delay and deleted this one's output).
    kept: Mutex<Option<Arc<DirLock>>>,
    /// Files of earlier runs this job's output replaces ([`Self::replacing`]), removed at its
    /// first commit; shared with the writers (whichever commits first removes them).
    replaced: Arc<Mutex<Option<Vec<PathBuf>>>>,
}

impl<F> TransactionalFileSink<F> {
    /// A sink writing into `dir` (created if missing); `format` renders one record as one line
    /// (without the line break).
    pub fn new(dir: impl Into<PathBuf>, format: F) -> Self {
        Self {
            dir: dir.into(),
            format: Arc::new(format),
            part_size: DEFAULT_PART_SIZE_BYTES,
            fs: Arc::new(StdFs),
            lock: Mutex::new(Weak::new()),
            kept: Mutex::new(None),
            replaced: Arc::new(Mutex::new(None)),
        }
    }

    /// Replace `files` (earlier runs' output in the directory): they are removed at this
    /// job's first commit, once a checkpoint is complete, rather than before the job starts.
    /// Removed before, a run that failed while it set up (an unknown column, a checkpoint
    /// directory it could not create) had deleted the earlier output and written none. The
    /// writers number their part files past every file in the directory, so none of the
    /// replaced names is one of theirs.
    pub fn replacing(self, files: Vec<PathBuf>) -> Self {
        *self.replaced.lock().unwrap_or_else(|e| e.into_inner()) = Some(files);
        self
    }

    /// Write under `lock`, the output directory's [`SINK_LOCK_FILE`] lock that the caller
    /// already holds (taken, say, to clear the directory before the job starts: released
    /// in between, another job could take the directory). It must be the lock of this
    /// sink's directory.
    pub fn with_lock(self, lock: DirLock) -> Self {
        let lock = Arc::new(lock);
        *self.lock.lock().unwrap_or_else(|e| e.into_inner()) = Arc::downgrade(&lock);
        *self.kept.lock().unwrap_or_else(|e| e.into_inner()) = Some(lock);
        self
    }

    /// The output directory's lock, taken if no writer of this sink holds it yet. Another
    /// holder (another job, in this process or another) is an error naming the lock file.
    fn lock_dir(&self) -> io::Result<Arc<DirLock>> {
        let mut held = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(lock) = held.upgrade() {
            return Ok(lock);
        }
        // The directory first: the lock file lives in it.
        weir_io::create_dir_all_durable(&*self.fs, &self.dir).map_err(to_io)?;
        let lock = Arc::new(DirLock::acquire_named(&self.dir, SINK_LOCK_FILE).map_err(
            |e| match e {
                IoError::Locked { lock_file, .. } => io::Error::new(
                    io::ErrorKind::WouldBlock,
                    format!(
                        "in use by another job ({} is locked); \
                         give each job its own output directory",
                        lock_file.display()
                    ),
                ),
                e => to_io(e),
            },
        )?);
        *held = Arc::downgrade(&lock);
        *self.kept.lock().unwrap_or_else(|e| e.into_inner()) = Some(lock.clone());
        Ok(lock)
    }

    /// Start a new part file once the current one holds at least `n` bytes (default
    /// 128 MiB). A part may exceed `n` by at most one line. `0` counts as 1.
    pub fn with_part_size_bytes(mut self, n: u64) -> Self {
        self.part_size = n.max(1);
        self
    }

    /// Use another file-system implementation (for example `weir_io::FaultyFs` in crash tests).
    pub fn with_fs(mut self, fs: Arc<dyn Fs>) -> Self {
        self.fs = fs;
        self
    }
}

impl<T: 'static, F: Fn(&T, &mut String) + Send + Sync + 'static> Sink<T>
    for TransactionalFileSink<F>
{
    fn create_writer(
        &self,
        shard: usize,
        shards: usize,
    ) -> Result<Box<dyn SinkWriter<T>>, StartError> {
        let output_dir = |source| StartError::OutputDir {
            path: self.dir.clone(),
            source,
        };
        // Before the writer lists the directory: what it finds there must be this job's.
        let lock = self.lock_dir().map_err(output_dir)?;
        let mut w =
            TransactionalFileWriter::open(self.fs.clone(), &self.dir, shard, self.part_size)
                .map_err(output_dir)?
                .with_shards(shards);
        w.replaced = Some(self.replaced.clone());
        Ok(Box::new(FormattedWriter {
            w,
            format: self.format.clone(),
            line: String::new(),
            _lock: lock,
        }))
    }

    fn name(&self) -> &str {
        "transactional-file"
    }
}

/// Renders records with the sink's format and hands the lines to the writer.
struct FormattedWriter<F> {
    w: TransactionalFileWriter,
    format: Arc<F>,
    line: String,
    /// The output directory's lock, held as long as the writer.
    _lock: Arc<DirLock>,
}

impl<T: 'static, F: Fn(&T, &mut String) + Send + Sync + 'static> SinkWriter<T>
    for FormattedWriter<F>
{
    fn write(&mut self, rec: T, _ts: i64) -> io::Result<()> {
        self.line.clear();
        (self.format)(&rec, &mut self.line);
        self.w.write_line(&self.line)
    }
    fn finish(&mut self) -> io::Result<()> {
        self.w.finish()
    }
    fn pre_commit(&mut self, checkpoint_id: u64) -> io::Result<Vec<u8>> {
        self.w.pre_commit(checkpoint_id)
    }
    fn commit(&mut self, checkpoint_id: u64) -> io::Result<()> {
        self.w.commit(checkpoint_id)
    }
    fn restore(&mut self, checkpoint_id: u64, state: &[u8]) -> io::Result<()> {
        self.w.restore(checkpoint_id, state)
    }
    fn allow_rewind(&mut self, allowed: bool) {
        self.w.rewind_allowed = allowed;
    }
    fn check_restore(&mut self, checkpoint_id: u64, states: &[&[u8]]) -> io::Result<()> {
        self.w.check_restore(checkpoint_id, states)
    }
}

/// The hidden, still growing part file.
#[derive(Debug)]
struct InProgress {
    file: Box<dyn FsFile>,
    path: PathBuf,
    seq: u64,
    /// Bytes already written to the file (the buffer comes after them).
    written: u64,
    buf: Vec<u8>,
}

/// A closed in-progress file: fsynced, its size and CRC known, not yet pre-committed.
#[derive(Debug)]
struct Sealed {
    path: PathBuf,
    seq: u64,
    size: u64,
    crc: u32,
}

/// A pre-committed file waiting for its checkpoint to complete. Its names derive from
/// `(shard, seq, checkpoint)`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct PendingFile {
    seq: u64,
    /// The checkpoint whose pre-commit prepared it.
    checkpoint: u64,
    size: u64,
    crc: u32,
}

/// A decoded pre-commit description.
#[derive(Debug, PartialEq, Eq)]
struct State {
    checkpoint: u64,
    shard: u32,
    next_seq: u64,
    /// The writer's directory, absolute (version 2; `None` in version 1: the restoring
    /// writer's own).
    dir: Option<PathBuf>,
    files: Vec<PendingFile>,
    /// Version 3, in shard 0's description: the shard indices at or above the job's shard
    /// count that had visible part files in the directory, each with the number after its
    /// last one (empty in other shards'). `None` before version 3: not recorded.
    others: Option<Vec<(u32, u64)>>,
}

/// What a file name in the output directory says about the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Final,
    InProgress,
    Pending(u64),
}

fn inprogress_name(shard: u32, seq: u64) -> String {
    format!(".part-{shard}-{seq}.inprogress")
}

fn pending_name(shard: u32, seq: u64, checkpoint: u64) -> String {
    format!(".part-{shard}-{seq}.pending-{checkpoint}")
}

fn final_name(shard: u32, seq: u64) -> String {
    format!("part-{shard}-{seq}.csv")
}

fn name_of(shard: u32, seq: u64, kind: Kind) -> String {
    match kind {
        Kind::Final => final_name(shard, seq),
        Kind::InProgress => inprogress_name(shard, seq),
        Kind::Pending(n) => pending_name(shard, seq, n),
    }
}

/// Parses one of this sink's file names into `(shard, seq, kind)`; anything else (other
/// files, the plain file sink's `part-<s>.csv`) is `None`.
fn parse_name(name: &str) -> Option<(u32, u64, Kind)> {
    let (body, kind) = if let Some(rest) = name.strip_prefix(".part-") {
        if let Some(body) = rest.strip_suffix(".inprogress") {
            (body, Kind::InProgress)
        } else {
            let (body, n) = rest.rsplit_once(".pending-")?;
            (body, Kind::Pending(n.parse().ok()?))
        }
    } else {
        (
            name.strip_prefix("part-")?.strip_suffix(".csv")?,
            Kind::Final,
        )
    };
    let (shard, seq) = body.split_once('-')?;
    let (shard, seq) = (shard.parse().ok()?, seq.parse().ok()?);
    // Only canonical spellings ("+1" or "01" parse too): a name must round-trip.
    (name_of(shard, seq, kind) == name).then_some((shard, seq, kind))
}

/// Turns a `weir_io` error into an `io::Error` of the same kind, keeping its message (which
/// names the operation and the path).
fn to_io(e: IoError) -> io::Error {
    let kind = match &e {
        IoError::Os { source, .. } => source.kind(),
        _ => io::ErrorKind::Other,
    };
    io::Error::new(kind, e)
}

fn invalid_state(msg: impl Display) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("transactional file sink state: {msg}"),
    )
}

/// The length of `path`, or `None` if it does not exist.
fn file_len(fs: &dyn Fs, path: &Path) -> io::Result<Option<u64>> {
    match fs.open(path) {
        Ok(f) => f.len().map(Some).map_err(to_io),
        Err(IoError::Os { source, .. }) if source.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(to_io(e)),
    }
}

/// CRC-32 of a sealed file's whole content.
fn file_crc(fs: &dyn Fs, path: &Path) -> io::Result<(u64, u32)> {
    let map = fs.map_readonly(path).map_err(to_io)?;
    Ok((map.len() as u64, crc32(&[&map])))
}

/// One shard's writer of a [`TransactionalFileSink`], line by line (the protocol is described
/// there and in `docs/file-sink.md`).
///
/// After any I/O failure the writer refuses further work until [`restore`](Self::restore):
/// a failed fsync may have lost data that a retry would not notice (PLATFORM.md, Durability).
#[derive(Debug)]
pub struct TransactionalFileWriter {
    fs: Arc<dyn Fs>,
    dir: PathBuf,
    /// `dir` made absolute (symbolic links resolved): what descriptions record, and what a
    /// restore compares their directory with.
    abs_dir: PathBuf,
    shard: u32,
    part_size: u64,
    /// Sequence number of the next part file; never goes down.
    next_seq: u64,
    current: Option<InProgress>,
    sealed: Vec<Sealed>,
    pending: Vec<PendingFile>,
    /// Why the writer can no longer be trusted, after a failed operation.
    poisoned: Option<String>,
    /// Whether a restore handed this writer the description written by a writer of its own
    /// shard index: only then may it delete its index's unlisted pending files of checkpoints
    /// up to the restored one (otherwise another shard may still have to publish them).
    own_state_restored: bool,
    /// The job's shard count ([`Self::with_shards`]; `u32::MAX` when not told).
    shards: u32,
    /// Shard indices at or above `shards` (old shards of a job restored onto fewer) whose
    /// descriptions a restore handed this writer, for the files in its directory: their
    /// hidden files are this writer's to clean up, as its own are.
    orphans: std::collections::BTreeSet<u32>,
    /// See [`Self::with_rewind_allowed`].
    rewind_allowed: bool,
    /// Shard 0's record of the other indices' part files ([`State::others`]), taken at its
    /// first pre-commit: every restore of the attempt is done by then, and nothing else
    /// writes those indices while the job runs.
    others: Option<Vec<(u32, u64)>>,
    /// The sink's files to replace at the first commit ([`TransactionalFileSink::replacing`]).
    replaced: Option<Arc<Mutex<Option<Vec<PathBuf>>>>>,
}

impl TransactionalFileWriter {
    /// Creates `dir` if needed and prepares shard `shard`'s writer. The first part file's
    /// sequence number follows every one of this shard's files already in `dir`.
    pub fn open(fs: Arc<dyn Fs>, dir: &Path, shard: usize, part_size: u64) -> io::Result<Self> {
        let shard = u32::try_from(shard).map_err(|_| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("shard index {shard} does not fit the part file names (u32)"),
            )
        })?;
        // Durably: a power cut must not take the directory with the files committed in it.
        weir_io::create_dir_all_durable(&*fs, dir).map_err(to_io)?;
        let abs_dir = std::fs::canonicalize(dir)?;
        let mut w = Self {
            fs,
            dir: dir.to_owned(),
            abs_dir,
            shard,
            part_size: part_size.max(1),
            next_seq: 0,
            current: None,
            sealed: Vec::new(),
            pending: Vec::new(),
            poisoned: None,
            own_state_restored: false,
            shards: u32::MAX,
            orphans: std::collections::BTreeSet::new(),
            rewind_allowed: false,
            others: None,
            replaced: None,
        };
        for (_, seq, _) in w.own_files()? {
            // Saturating: a part named with the largest number (a forged or foreign file)
            // must not wrap the count back to files that exist; `create` then refuses it.
            w.next_seq = w.next_seq.max(seq.saturating_add(1));
        }
        Ok(w)
    }

    /// The output directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Appends `line` and a '\n' to the in-progress file (created on first use), and rolls to
    /// a new part file once this one reaches the part size.
    pub fn write_line(&mut self, line: &str) -> io::Result<()> {
        self.guard(|w| w.write_line_inner(line))
    }

    /// Prepares checkpoint `checkpoint_id`: makes everything written since the last pre-commit
    /// durable under hidden pending names and returns the description of every file not yet
    /// committed (the bytes to store in the checkpoint).
    pub fn pre_commit(&mut self, checkpoint_id: u64) -> io::Result<Vec<u8>> {
        self.guard(|w| w.pre_commit_inner(checkpoint_id))
    }

    /// Checkpoint `checkpoint_id` is complete: publishes every file prepared at or before it.
    /// Idempotent.
    pub fn commit(&mut self, checkpoint_id: u64) -> io::Result<()> {
        self.guard(|w| w.commit_inner(checkpoint_id))
    }

    /// The job restarts from checkpoint `checkpoint_id`, for which a writer's
    /// [`pre_commit`](Self::pre_commit) returned `state` (empty: no description). Publishes the
    /// files `state` lists (whichever shard wrote them) unless already published, then deletes
    /// this shard's hidden files holding output from after the checkpoint. May be called more
    /// than once (one call per description handed to this shard).
    pub fn restore(&mut self, checkpoint_id: u64, state: &[u8]) -> io::Result<()> {
        // A restore starts over: whatever this writer held is either listed in `state` or is
        // output from after the checkpoint, which cleanup deletes.
        self.poisoned = None;
        self.current = None;
        self.sealed.clear();
        self.pending.clear();
        self.guard(|w| w.restore_inner(checkpoint_id, state))
    }

    /// The input ended without a final checkpoint: makes everything written since the last
    /// pre-commit durable and visible at once. Files already pre-committed stay for
    /// [`commit`](Self::commit). With nothing written, no I/O at all.
    pub fn finish(&mut self) -> io::Result<()> {
        self.guard(Self::finish_inner)
    }

    /// Runs `op` unless the writer is poisoned, and poisons it if `op` fails.
    fn guard<R>(&mut self, op: impl FnOnce(&mut Self) -> io::Result<R>) -> io::Result<R> {
        if let Some(why) = &self.poisoned {
            return Err(io::Error::other(format!(
                "transactional file sink {} shard {}: an earlier operation failed ({why}); \
                 the job must restore from a checkpoint",
                self.dir.display(),
                self.shard
            )));
        }
        let r = op(self);
        if let Err(e) = &r {
            self.poisoned = Some(e.to_string());
        }
        r
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// The job runs `shards` shards. A restore onto fewer shards than the checkpoint's then
    /// also cleans up the hidden files of the old shard indices whose descriptions it is
    /// handed (each old description goes to one new shard): nobody else writes or publishes
    /// those indices any more, so without this their after-checkpoint files stayed hidden in
    /// the directory for good. [`TransactionalFileSink`] tells its writers.
    pub fn with_shards(mut self, shards: usize) -> Self {
        self.shards = u32::try_from(shards).unwrap_or(u32::MAX);
        self
    }

    /// Whether a restore may go back behind output already committed in the directory. A
    /// checkpoint's description records the next part number of its shard; a visible part
    /// file of that shard numbered from there on in this writer's directory was committed
    /// after the checkpoint (a later checkpoint's commit, or an earlier restore of the same
    /// checkpoint into this directory), and the records it holds are replayed after the
    /// restore, so they would be in the directory twice. Such a restore (`--restore` of an
    /// older checkpoint or a savepoint, into the directory the job went on writing, or again)
    /// fails with `InvalidData` naming the file, before it changes anything, unless allowed
    /// here (as a job's sink writer it is told the job's `JobConfig::with_allow_fallback`).
    /// Files of shard indices the checkpoint did not have (a job scaled up after it) are
    /// checked against shard 0's record of them (description version 3).
    pub fn with_rewind_allowed(mut self, allowed: bool) -> Self {
        self.rewind_allowed = allowed;
        self
    }

    /// This shard's files in the directory: `(path, seq, kind)`.
    fn own_files(&self) -> io::Result<Vec<(PathBuf, u64, Kind)>> {
        Ok(self
            .files_of(|s| s == self.shard)?
            .into_iter()
            .map(|(path, _, seq, kind)| (path, seq, kind))
            .collect())
    }

    /// The files in the directory of the shard indices `which` takes: `(path, shard, seq, kind)`.
    fn files_of(&self, which: impl Fn(u32) -> bool) -> io::Result<Vec<(PathBuf, u32, u64, Kind)>> {
        let mut out = Vec::new();
        for path in self.fs.list_dir(&self.dir).map_err(to_io)? {
            let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
                continue;
            };
            if let Some((shard, seq, kind)) = parse_name(name) {
                if which(shard) {
                    if seq == u64::MAX {
                        // The sink never writes it (no number would be left for the next
                        // part), so it is forged or foreign. Refused as the writer opens:
                        // invalid data fails the job without a restart, which would meet it
                        // again (writing then failed on every attempt, restarting forever).
                        return Err(io::Error::new(
                            io::ErrorKind::InvalidData,
                            format!(
                                "{}: part number {seq} is one this sink never writes (it would \
                                 leave none for the next part): a file of another program; \
                                 move it away",
                                path.display()
                            ),
                        ));
                    }
                    out.push((path, shard, seq, kind));
                }
            }
        }
        Ok(out)
    }

    fn sync_dir(&self) -> io::Result<()> {
        self.fs.sync_dir(&self.dir).map_err(to_io)
    }

    fn write_line_inner(&mut self, line: &str) -> io::Result<()> {
        if self.current.is_none() {
            let seq = self.next_seq;
            let next = seq.checked_add(1).ok_or_else(|| {
                io::Error::other(format!(
                    "{}: part numbers of shard {} are used up",
                    self.dir.display(),
                    self.shard
                ))
            })?;
            let path = self.path(&inprogress_name(self.shard, seq));
            // `create` fails if the file exists: a name is never reused silently.
            let file = self.fs.create(&path).map_err(to_io)?;
            self.next_seq = next;
            self.current = Some(InProgress {
                file,
                path,
                seq,
                written: 0,
                buf: Vec::with_capacity(WRITE_BUFFER_BYTES),
            });
        }
        let mut full = false;
        if let Some(cur) = &mut self.current {
            cur.buf.extend_from_slice(line.as_bytes());
            cur.buf.push(b'\n');
            if cur.buf.len() >= WRITE_BUFFER_BYTES {
                flush(cur)?;
            }
            full = cur.written + cur.buf.len() as u64 >= self.part_size;
        }
        if full {
            self.seal_current()?;
        }
        Ok(())
    }

    /// Closes the in-progress file (if any): write out the buffer, fsync, compute the CRC.
    fn seal_current(&mut self) -> io::Result<()> {
        let Some(mut cur) = self.current.take() else {
            return Ok(());
        };
        flush(&mut cur)?;
        cur.file.sync().map_err(to_io)?;
        let (size, crc) = file_crc(&*self.fs, &cur.path)?;
        if size != cur.written {
            return Err(io::Error::other(format!(
                "{}: {size} bytes after fsync, {} written",
                cur.path.display(),
                cur.written
            )));
        }
        self.sealed.push(Sealed {
            path: cur.path,
            seq: cur.seq,
            size,
            crc,
        });
        Ok(())
    }

    fn pre_commit_inner(&mut self, checkpoint: u64) -> io::Result<Vec<u8>> {
        self.seal_current()?;
        if !self.sealed.is_empty() {
            for s in std::mem::take(&mut self.sealed) {
                let to = self.path(&pending_name(self.shard, s.seq, checkpoint));
                self.fs.rename(&s.path, &to).map_err(to_io)?;
                self.pending.push(PendingFile {
                    seq: s.seq,
                    checkpoint,
                    size: s.size,
                    crc: s.crc,
                });
            }
            self.sync_dir()?;
        }
        let others = match (&self.others, self.shard) {
            (Some(o), _) => o.clone(),
            (None, 0) => {
                // Not the earlier runs' files that the first commit removes: they are not in
                // the directory as the checkpoint leaves it.
                let going: HashSet<std::ffi::OsString> = self
                    .replaced
                    .as_ref()
                    .and_then(|r| r.lock().unwrap_or_else(|e| e.into_inner()).clone())
                    .unwrap_or_default()
                    .iter()
                    .filter_map(|p| p.file_name().map(ToOwned::to_owned))
                    .collect();
                let mut next: BTreeMap<u32, u64> = BTreeMap::new();
                for (path, shard, seq, kind) in self.files_of(|s| s >= self.shards)? {
                    if path.file_name().is_some_and(|n| going.contains(n)) {
                        continue;
                    }
                    if kind == Kind::Final {
                        let n = next.entry(shard).or_default();
                        *n = (*n).max(seq.saturating_add(1));
                    }
                }
                let o: Vec<(u32, u64)> = next.into_iter().collect();
                self.others = Some(o.clone());
                o
            }
            (None, _) => Vec::new(),
        };
        Ok(encode_state(&State {
            checkpoint,
            shard: self.shard,
            next_seq: self.next_seq,
            dir: Some(self.abs_dir.clone()),
            files: self.pending.clone(),
            others: Some(others),
        }))
    }

    fn commit_inner(&mut self, checkpoint: u64) -> io::Result<()> {
        let mut renamed = false;
        let earlier = self
            .replaced
            .as_ref()
            .and_then(|r| r.lock().unwrap_or_else(|e| e.into_inner()).take());
        for path in earlier.unwrap_or_default() {
            match self.fs.remove(&path) {
                Ok(()) => renamed = true,
                // Gone already (removed by hand, say): replaced all the same.
                Err(IoError::Os { source, .. }) if source.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(to_io(e)),
            }
        }
        while let Some(i) = self.pending.iter().position(|p| p.checkpoint <= checkpoint) {
            let p = &self.pending[i];
            let from = self.path(&pending_name(self.shard, p.seq, p.checkpoint));
            let to = self.path(&final_name(self.shard, p.seq));
            self.fs.rename(&from, &to).map_err(to_io)?;
            self.pending.remove(i);
            renamed = true;
        }
        if renamed {
            self.sync_dir()?;
        }
        Ok(())
    }

    fn restore_inner(&mut self, checkpoint: u64, bytes: &[u8]) -> io::Result<()> {
        let mut changed = false;
        if !bytes.is_empty() {
            let state = decode_state(bytes)?;
            if state.checkpoint != checkpoint {
                return Err(invalid_state(format!(
                    "describes checkpoint {}, but the job restores checkpoint {checkpoint}",
                    state.checkpoint
                )));
            }
            // A job restored into another output directory (from a savepoint, say) finds the
            // checkpoint's files where they were written, and publishes them there, as
            // Flink's file sink commits its recovered files at their recorded paths.
            let dir = match &state.dir {
                Some(d) if *d != self.abs_dir => d.clone(),
                _ => self.dir.clone(),
            };
            if !self.rewind_allowed {
                self.refuse_committed_after(checkpoint, &state)?;
            }
            let mut published = false;
            for f in &state.files {
                published |= self.publish_restored(&dir, state.shard, f, checkpoint)?;
            }
            if dir == self.dir {
                changed |= published;
            } else if published {
                self.fs.sync_dir(&dir).map_err(to_io)?;
            }
            if state.shard == self.shard {
                self.own_state_restored = true;
                self.next_seq = self.next_seq.max(state.next_seq);
            }
            if state.shard >= self.shards && dir == self.dir {
                self.orphans.insert(state.shard);
            }
        }
        // Cleanup: only the hidden files of this shard index, and of old indices that no
        // longer run whose descriptions came here. In-progress files and files pending for a
        // later checkpoint hold output from after the checkpoint, which will be produced
        // again. Pending files of this or an earlier checkpoint that are still hidden were not
        // listed (listed ones are published now): garbage, but only certain once the index's
        // own description was seen; before, another shard may still have to publish them.
        let own = self.shard;
        for (path, shard, seq, kind) in self.files_of(|s| s == own || self.orphans.contains(&s))? {
            let described = if shard == own {
                self.next_seq = self.next_seq.max(seq.saturating_add(1));
                self.own_state_restored
            } else {
                true
            };
            let delete = match kind {
                Kind::Final => false,
                Kind::InProgress => true,
                Kind::Pending(n) => n > checkpoint || described,
            };
            if delete {
                self.fs.remove(&path).map_err(to_io)?;
                changed = true;
            }
        }
        if changed {
            self.sync_dir()?;
        }
        Ok(())
    }

    /// Checks a restore of checkpoint `checkpoint` from the descriptions `states` of all its
    /// shards makes before any shard's restore changes anything: [`Self::with_rewind_allowed`]
    /// for each of them, not only for the ones this writer is handed.
    pub fn check_restore(&self, checkpoint: u64, states: &[&[u8]]) -> io::Result<()> {
        if self.rewind_allowed {
            return Ok(());
        }
        let mut described = HashSet::new();
        let mut others = None;
        for bytes in states.iter().filter(|b| !b.is_empty()) {
            let state = decode_state(bytes)?;
            if state.checkpoint == checkpoint {
                self.refuse_committed_after(checkpoint, &state)?;
                described.insert(state.shard);
                if state.shard == 0 {
                    others = state.others.map(|o| (o, state.dir));
                }
            }
        }
        // Shard indices the checkpoint did not have: their part files at or past the number
        // shard 0 recorded were committed after it (by the job scaled up since). Without
        // the record (a description before version 3) they cannot be told from an earlier
        // run's, scaled down before the checkpoint, and are not checked.
        let Some((others, dir)) = others else {
            return Ok(());
        };
        // A record of another directory says nothing of this one: there, as for the indices
        // described, every such file is output of an earlier restore of this checkpoint.
        let recorded: BTreeMap<u32, u64> = if dir.as_deref() == Some(self.abs_dir.as_path()) {
            others.into_iter().collect()
        } else {
            BTreeMap::new()
        };
        let mut later: Vec<(u32, u64, PathBuf)> = self
            .files_of(|s| !described.contains(&s))?
            .into_iter()
            .filter(|(_, s, seq, kind)| {
                *kind == Kind::Final && *seq >= recorded.get(s).copied().unwrap_or(0)
            })
            .map(|(path, s, seq, _)| (s, seq, path))
            .collect();
        later.sort();
        let Some((shard, _, first)) = later.first() else {
            return Ok(());
        };
        Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "{} was committed after checkpoint {checkpoint} ({} such file{} of shard indices \
                 the checkpoint did not have, the first of index {shard}): restoring checkpoint \
                 {checkpoint} into this directory would write their records a second time. \
                 Restore the newest checkpoint, or move those files away, or accept the \
                 duplicates with --allow-fallback (JobConfig::with_allow_fallback)",
                first.display(),
                later.len(),
                if later.len() == 1 { "" } else { "s" },
            ),
        ))
    }

    /// See [`Self::with_rewind_allowed`]: the visible files of the description's shard in
    /// this writer's directory committed after its checkpoint (after a restore into another
    /// directory, the output a restore of the same checkpoint wrote there before).
    fn refuse_committed_after(&self, checkpoint: u64, state: &State) -> io::Result<()> {
        let mut later: Vec<(u64, PathBuf)> = self
            .files_of(|s| s == state.shard)?
            .into_iter()
            .filter(|(_, _, seq, kind)| *kind == Kind::Final && *seq >= state.next_seq)
            .map(|(path, _, seq, _)| (seq, path))
            .collect();
        later.sort();
        let Some((_, first)) = later.first() else {
            return Ok(());
        };
        Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "{} was committed after checkpoint {checkpoint} ({} such file{} of shard {}, \
                 part numbers from {} on): restoring checkpoint {checkpoint} into this \
                 directory would write their records a second time. Restore the newest \
                 checkpoint, or move those files away, or accept the duplicates with \
                 --allow-fallback (JobConfig::with_allow_fallback)",
                first.display(),
                later.len(),
                if later.len() == 1 { "" } else { "s" },
                state.shard,
                state.next_seq
            ),
        ))
    }

    /// Publishes one file listed by a restored description, in `dir`; `Ok(true)` if it
    /// renamed it.
    fn publish_restored(
        &self,
        dir: &Path,
        shard: u32,
        f: &PendingFile,
        checkpoint: u64,
    ) -> io::Result<bool> {
        let hidden = dir.join(pending_name(shard, f.seq, f.checkpoint));
        let visible = dir.join(final_name(shard, f.seq));
        if let Some(len) = file_len(&*self.fs, &hidden)? {
            // Check the bytes before making them visible: a pending file that does not match
            // its description must not be published.
            let (size, crc) = file_crc(&*self.fs, &hidden)?;
            if len != f.size || size != f.size || crc != f.crc {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!(
                        "{}: checkpoint {checkpoint} recorded {} bytes with CRC {:#010x}, \
                         the file has {size} bytes with CRC {crc:#010x}",
                        hidden.display(),
                        f.size,
                        f.crc
                    ),
                ));
            }
            self.fs.rename(&hidden, &visible).map_err(to_io)?;
            return Ok(true);
        }
        match file_len(&*self.fs, &visible)? {
            // Published before the crash.
            Some(len) if len == f.size => Ok(false),
            Some(len) => Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "{}: checkpoint {checkpoint} recorded {} bytes, the published file has {len}",
                    visible.display(),
                    f.size
                ),
            )),
            None => Err(io::Error::new(
                io::ErrorKind::NotFound,
                format!(
                    "checkpoint {checkpoint} refers to output file {} that is gone: neither \
                     pending {} nor published {} exists",
                    final_name(shard, f.seq),
                    hidden.display(),
                    visible.display()
                ),
            )),
        }
    }

    fn finish_inner(&mut self) -> io::Result<()> {
        self.seal_current()?;
        if self.sealed.is_empty() {
            return Ok(());
        }
        for s in std::mem::take(&mut self.sealed) {
            let to = self.path(&final_name(self.shard, s.seq));
            self.fs.rename(&s.path, &to).map_err(to_io)?;
        }
        self.sync_dir()
    }
}

/// Writes out the buffer of the in-progress file.
fn flush(cur: &mut InProgress) -> io::Result<()> {
    if !cur.buf.is_empty() {
        cur.file.write_at(cur.written, &cur.buf).map_err(to_io)?;
        cur.written += cur.buf.len() as u64;
        cur.buf.clear();
    }
    Ok(())
}

/// Encodes a pre-commit description (format in `docs/file-sink.md`).
fn encode_state(s: &State) -> Vec<u8> {
    let mut out = Vec::with_capacity(STATE_HEADER_LEN + 64 * s.files.len() + STATE_TRAILER_LEN);
    out.extend_from_slice(&STATE_MAGIC);
    out.push(STATE_VERSION);
    out.push(CHECKSUM_CRC32_IEEE);
    out.extend_from_slice(&[0, 0]);
    out.extend_from_slice(&s.checkpoint.to_le_bytes());
    out.extend_from_slice(&s.shard.to_le_bytes());
    // The count fits: a writer cannot have 2^32 files pending.
    out.extend_from_slice(&(s.files.len() as u32).to_le_bytes());
    out.extend_from_slice(&s.next_seq.to_le_bytes());
    let dir = s.dir.as_deref().map(path_bytes).unwrap_or_default();
    // A directory path longer than 64 KiB is refused by every file system first.
    out.extend_from_slice(&(dir.len() as u16).to_le_bytes());
    out.extend_from_slice(dir);
    for f in &s.files {
        out.extend_from_slice(&f.seq.to_le_bytes());
        out.extend_from_slice(&f.checkpoint.to_le_bytes());
        out.extend_from_slice(&f.size.to_le_bytes());
        out.extend_from_slice(&f.crc.to_le_bytes());
        for name in [
            pending_name(s.shard, f.seq, f.checkpoint),
            final_name(s.shard, f.seq),
        ] {
            // Names are short ASCII: well below u16::MAX.
            out.extend_from_slice(&(name.len() as u16).to_le_bytes());
            out.extend_from_slice(name.as_bytes());
        }
    }
    let others = s.others.as_deref().unwrap_or_default();
    // At most one per shard index: fits a u32.
    out.extend_from_slice(&(others.len() as u32).to_le_bytes());
    for &(shard, next) in others {
        out.extend_from_slice(&shard.to_le_bytes());
        out.extend_from_slice(&next.to_le_bytes());
    }
    let crc = crc32(&[&out]);
    out.extend_from_slice(&crc.to_le_bytes());
    out
}

/// Reads fields from a description, naming the offset and field when bytes are missing.
struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &str) -> io::Result<&'a [u8]> {
        let left = self.bytes.len() - self.pos;
        if left < n {
            return Err(invalid_state(format!(
                "truncated at offset {} reading {what}: need {n} bytes, {left} left",
                self.pos
            )));
        }
        let s = &self.bytes[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &str) -> io::Result<[u8; N]> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N, what)?);
        Ok(a)
    }

    fn u16(&mut self, what: &str) -> io::Result<u16> {
        Ok(u16::from_le_bytes(self.array(what)?))
    }
    fn u32(&mut self, what: &str) -> io::Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }
    fn u64(&mut self, what: &str) -> io::Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// A length-prefixed name that must equal `expected`.
    fn name(&mut self, what: &str, expected: &str) -> io::Result<()> {
        let at = self.pos;
        let len = self.u16(what)? as usize;
        let raw = self.take(len, what)?;
        if raw != expected.as_bytes() {
            return Err(invalid_state(format!(
                "{what} at offset {at} is {:?}, expected {expected:?}",
                String::from_utf8_lossy(raw)
            )));
        }
        Ok(())
    }
}

/// Decodes and validates a pre-commit description. Every defect is an `InvalidData` error
/// saying what is wrong and where.
fn decode_state(bytes: &[u8]) -> io::Result<State> {
    let mut r = Reader { bytes, pos: 0 };
    let magic = r.array::<4>("magic")?;
    if magic != STATE_MAGIC {
        return Err(invalid_state(format!(
            "bad magic {magic:02x?}, expected {STATE_MAGIC:02x?} (not a transactional file sink \
             state)"
        )));
    }
    let [version, algo, _, _] = r.array::<4>("version")?;
    if !(1..=STATE_VERSION).contains(&version) {
        return Err(invalid_state(format!(
            "unsupported version {version} (supported: 1 to {STATE_VERSION})"
        )));
    }
    if algo != CHECKSUM_CRC32_IEEE {
        return Err(invalid_state(format!(
            "unknown checksum algorithm {algo} (supported: {CHECKSUM_CRC32_IEEE})"
        )));
    }
    if bytes.len() < STATE_HEADER_LEN + STATE_TRAILER_LEN {
        return Err(invalid_state(format!(
            "truncated: {} bytes, a description has at least {}",
            bytes.len(),
            STATE_HEADER_LEN + STATE_TRAILER_LEN
        )));
    }
    // Check the CRC before trusting any field it covers.
    let body_len = bytes.len() - STATE_TRAILER_LEN;
    let mut stored = [0u8; 4];
    stored.copy_from_slice(&bytes[body_len..]);
    let stored = u32::from_le_bytes(stored);
    let actual = crc32(&[&bytes[..body_len]]);
    if stored != actual {
        return Err(invalid_state(format!(
            "checksum mismatch over {body_len} bytes: stored {stored:#010x}, computed \
             {actual:#010x}"
        )));
    }
    let mut r = Reader {
        bytes: &bytes[..body_len],
        pos: r.pos,
    };
    let checkpoint = r.u64("checkpoint id")?;
    let shard = r.u32("shard")?;
    let count = r.u32("file count")? as usize;
    let next_seq = r.u64("next sequence number")?;
    let dir = if version >= 2 {
        let at = r.pos;
        let len = r.u16("directory length")? as usize;
        let raw = r.take(len, "directory")?;
        let dir = bytes_path(raw);
        if !dir.is_absolute() {
            return Err(invalid_state(format!(
                "directory at offset {at} is {:?}, not an absolute path",
                dir.display()
            )));
        }
        Some(dir)
    } else {
        None
    };
    let room = (body_len - r.pos) / STATE_MIN_ENTRY_LEN;
    if count > room {
        return Err(invalid_state(format!(
            "file count {count} cannot fit in {} bytes",
            body_len - r.pos
        )));
    }
    let mut files = Vec::with_capacity(count);
    let mut seqs = HashSet::with_capacity(count);
    for i in 0..count {
        let at = r.pos;
        let f = PendingFile {
            seq: r.u64("file sequence number")?,
            checkpoint: r.u64("file checkpoint id")?,
            size: r.u64("file size")?,
            crc: r.u32("file CRC")?,
        };
        r.name("pending name", &pending_name(shard, f.seq, f.checkpoint))?;
        r.name("final name", &final_name(shard, f.seq))?;
        if f.checkpoint > checkpoint {
            return Err(invalid_state(format!(
                "file {i} at offset {at} was prepared by checkpoint {}, after this checkpoint \
                 {checkpoint}",
                f.checkpoint
            )));
        }
        if f.seq >= next_seq {
            return Err(invalid_state(format!(
                "file {i} at offset {at} has sequence number {}, not below the next one \
                 {next_seq}",
                f.seq
            )));
        }
        if !seqs.insert(f.seq) {
            return Err(invalid_state(format!(
                "file {i} at offset {at} repeats sequence number {}",
                f.seq
            )));
        }
        files.push(f);
    }
    let others = if version >= 3 {
        let at = r.pos;
        let count = r.u32("other shard count")? as usize;
        if count > (body_len - r.pos) / 12 {
            return Err(invalid_state(format!(
                "other shard count {count} at offset {at} cannot fit in {} bytes",
                body_len - r.pos
            )));
        }
        let mut o: Vec<(u32, u64)> = Vec::with_capacity(count);
        for i in 0..count {
            let at = r.pos;
            let e = (r.u32("other shard")?, r.u64("other shard's next number")?);
            if shard != 0 || e.0 == 0 || o.last().is_some_and(|l| l.0 >= e.0) {
                return Err(invalid_state(format!(
                    "other shard {i} at offset {at} (index {}): only shard 0's description \
                     lists other indices, each once, ascending, none 0",
                    e.0
                )));
            }
            o.push(e);
        }
        Some(o)
    } else {
        None
    };
    if r.pos != body_len {
        return Err(invalid_state(format!(
            "{} unexpected bytes after the last file at offset {}",
            body_len - r.pos,
            r.pos
        )));
    }
    Ok(State {
        checkpoint,
        shard,
        next_seq,
        dir,
        files,
        others,
    })
}

/// A path's bytes as stored in a description (Unix paths are bytes).
fn path_bytes(p: &Path) -> &[u8] {
    use std::os::unix::ffi::OsStrExt;
    p.as_os_str().as_bytes()
}

fn bytes_path(b: &[u8]) -> PathBuf {
    use std::os::unix::ffi::OsStrExt;
    PathBuf::from(std::ffi::OsStr::from_bytes(b))
}

#[cfg(test)]
mod tests {
    use super::*;
    use weir_io::{FaultConfig, FaultyFs};

    type Fmt = fn(&String, &mut String);

    fn sink(dir: &Path) -> TransactionalFileSink<Fmt> {
        let format: Fmt = |rec, out| out.push_str(rec);
        TransactionalFileSink::new(dir, format)
    }

    fn writer(sink: &TransactionalFileSink<Fmt>, shard: usize) -> Box<dyn SinkWriter<String>> {
        writer_of(sink, shard, 2)
    }

    fn writer_of(
        sink: &TransactionalFileSink<Fmt>,
        shard: usize,
        shards: usize,
    ) -> Box<dyn SinkWriter<String>> {
        match Sink::<String>::create_writer(sink, shard, shards) {
            Ok(w) => w,
            Err(e) => panic!("create writer: {e}"),
        }
    }

    fn write_all(w: &mut dyn SinkWriter<String>, lines: &[String]) {
        for l in lines {
            w.write(l.clone(), 0).expect("write");
        }
    }

    fn lines(prefix: &str, range: std::ops::Range<usize>) -> Vec<String> {
        range.map(|i| format!("{prefix}-{i}")).collect()
    }

    /// Visible files' names, sorted.
    fn visible(dir: &Path) -> Vec<String> {
        names(dir)
            .into_iter()
            .filter(|n| !n.starts_with('.'))
            .collect()
    }

    /// Hidden part files' names, sorted (the sink's lock file is no part file).
    fn hidden(dir: &Path) -> Vec<String> {
        names(dir)
            .into_iter()
            .filter(|n| n.starts_with('.') && n != SINK_LOCK_FILE)
            .collect()
    }

    fn names(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .expect("read dir")
            .map(|e| {
                e.expect("dir entry")
                    .file_name()
                    .into_string()
                    .expect("utf-8")
            })
            .collect();
        v.sort();
        v
    }

    /// Every visible line, files in (shard, seq) order.
    fn visible_lines(dir: &Path) -> Vec<String> {
        let mut files: Vec<(u32, u64, String)> = visible(dir)
            .into_iter()
            .map(|n| {
                let (s, q, k) = parse_name(&n).expect("only our files");
                assert_eq!(k, Kind::Final);
                (s, q, n)
            })
            .collect();
        files.sort();
        let mut out = Vec::new();
        for (_, _, n) in files {
            let text = std::fs::read_to_string(dir.join(&n)).expect("read part");
            assert!(text.ends_with('\n'), "{n} ends mid-line");
            out.extend(text.lines().map(str::to_owned));
        }
        out
    }

    #[test]
    fn names_round_trip_and_foreign_names_are_ignored() {
        for kind in [Kind::Final, Kind::InProgress, Kind::Pending(7)] {
            let n = name_of(3, 41, kind);
            assert_eq!(parse_name(&n), Some((3, 41, kind)));
        }
        for n in [
            "part-0.csv",
            "part-01-2.csv",
            "part-+1-2.csv",
            ".part-1-2.pending-",
            ".part-1-2.tmp",
            "x",
        ] {
            assert_eq!(parse_name(n), None, "{n}");
        }
    }

    /// A part named with the largest sequence number (forged, or foreign; the sink never
    /// writes it) neither panics nor wraps the count back to 0: the shard's writer does not
    /// open, with invalid data naming the file (a job then fails without restarting: writing
    /// failed on every attempt, forever), and the file stays. Whatever its kind.
    #[test]
    fn a_part_numbered_u64_max_stops_the_writer_without_wrapping() {
        let tmp = tempfile::tempdir().expect("temp dir");
        let dir = tmp.path().join("out");
        std::fs::create_dir_all(&dir).expect("mkdir");
        let s = sink(&dir);
        for last in [
            final_name(0, u64::MAX),
            inprogress_name(0, u64::MAX),
            pending_name(0, u64::MAX, 3),
        ] {
            std::fs::write(dir.join(&last), "x\n").expect("write");
            let e = match Sink::<String>::create_writer(&s, 0, 2) {
                Ok(_) => panic!("{last}: opened"),
                Err(e) => e,
            };
            let msg = e.to_string();
            assert!(msg.contains(&last), "{msg}");
            assert!(
                matches!(&e, crate::StartError::OutputDir { source, .. }
                    if source.kind() == io::ErrorKind::InvalidData),
                "{msg}"
            );
            // Not recoverable: a restart would meet it again.
            assert!(!crate::JobError::Start(e).is_recoverable(), "{msg}");
            assert!(dir.join(&last).exists(), "{last} stays");
            std::fs::remove_file(dir.join(&last)).expect("rm");
        }
        let last = final_name(0, u64::MAX);
        std::fs::write(dir.join(&last), "x\n").expect("write");
        // Another shard's numbers are its own.
        let mut w1 = writer(&s, 1);
        write_all(&mut *w1, &lines("b", 0..3));
        w1.pre_commit(1).expect("pre-commit");
        w1.commit(1).expect("commit");
        assert!(names(&dir).contains(&final_name(1, 0)));
    }

    /// One job per output directory: a restore deletes hidden files of its shard indices that
    /// its checkpoint does not list, which would be another job's. A second sink on the
    /// directory is refused, naming the lock file, while the first one's writers exist (its
    /// shards share the lock), and while the first sink itself does, its writers gone (between
    /// a failed attempt and its restart: another job took the directory then); once it is
    /// dropped with its job the directory is free again.
    #[test]
    fn a_second_sink_on_an_output_directory_is_refused_while_the_first_writes() {
        let tmp = tempfile::tempdir().expect("temp dir");
        let dir = tmp.path().join("out");
        let first = sink(&dir);
        let mut w0 = writer(&first, 0);
        let w1 = writer(&first, 1);
        write_all(&mut *w0, &lines("a", 0..3));
        let other = sink(&dir);
        let refused = |s: &TransactionalFileSink<Fmt>| match Sink::<String>::create_writer(s, 0, 2)
        {
            Ok(_) => panic!("a second sink wrote into a locked directory"),
            Err(e) => e,
        };
        let e = refused(&other);
        assert!(
            matches!(&e, StartError::OutputDir { path, .. } if *path == dir),
            "{e}"
        );
        let lock = dir.join(SINK_LOCK_FILE);
        assert!(e.to_string().contains(&lock.display().to_string()), "{e}");
        assert_eq!(hidden(&dir), [inprogress_name(0, 0)]);
        // Still held while any writer of the first sink exists, and then by the sink.
        drop(w0);
        refused(&other);
        drop(w1);
        refused(&other);
        drop(first);
        let mut w = writer(&other, 0);
        write_all(&mut *w, &lines("b", 0..2));
        w.finish().expect("finish");
        // Its restore-free start left the first sink's abandoned file alone and numbered past it.
        assert!(
            visible(&dir).contains(&final_name(0, 1)),
            "{:?}",
            names(&dir)
        );
    }

    /// Files a sink replaces stay until its first commit (a run that failed as it set up had
    /// deleted them and written nothing), and go then, whichever shard commits first.
    #[test]
    fn replaced_files_go_at_the_first_commit() {
        let tmp = tempfile::tempdir().expect("temp dir");
        let dir = tmp.path().join("out");
        std::fs::create_dir(&dir).expect("mkdir");
        let old: Vec<PathBuf> = ["part-0.csv", "part-0-0.csv", ".part-3-1.inprogress"]
            .iter()
            .map(|n| dir.join(n))
            .collect();
        for f in &old {
            std::fs::write(f, "old\n").expect("write");
        }
        let s = sink(&dir).replacing(old.clone());
        let (mut w0, mut w1) = (writer(&s, 0), writer(&s, 1));
        write_all(&mut *w0, &lines("a", 0..2));
        w0.pre_commit(1).expect("pre-commit");
        w1.pre_commit(1).expect("pre-commit");
        assert!(
            old.iter().all(|f| f.exists()),
            "kept until the first commit"
        );
        w1.commit(1).expect("commit");
        assert!(old.iter().all(|f| !f.exists()), "{:?}", names(&dir));
        w0.commit(1).expect("commit");
        assert_eq!(visible_lines(&dir), lines("a", 0..2));
    }

    /// A sink handed the lock its caller took (to clear the directory first) writes under it,
    /// with no moment in between where another job could take the directory.
    #[test]
    fn a_sink_writes_under_the_lock_it_is_handed() {
        let tmp = tempfile::tempdir().expect("temp dir");
        let dir = tmp.path().join("out");
        std::fs::create_dir(&dir).expect("mkdir");
        let lock = DirLock::acquire_named(&dir, SINK_LOCK_FILE).expect("lock");
        let first = sink(&dir).with_lock(lock);
        assert!(
            DirLock::acquire_named(&dir, SINK_LOCK_FILE).is_err(),
            "held"
        );
        let mut w = writer(&first, 0);
        write_all(&mut *w, &lines("a", 0..2));
        w.finish().expect("finish");
        drop(w);
        assert!(
            Sink::<String>::create_writer(&sink(&dir), 0, 1).is_err(),
            "still held"
        );
        drop(first);
        DirLock::acquire_named(&dir, SINK_LOCK_FILE).expect("free with the sink gone");
    }

    #[test]
    fn commit_publishes_exactly_what_was_prepared() {
        let tmp = tempfile::tempdir().expect("temp dir");
        let dir = tmp.path().join("out");
        let s = sink(&dir);
        let mut w = writer(&s, 0);
        let a = lines("a", 0..100);
        write_all(&mut *w, &a);
        let st1 = w.pre_commit(1).expect("pre-commit 1");
        assert!(visible(&dir).is_empty(), "nothing visible before commit");
        assert_eq!(hidden(&dir), vec![".part-0-0.pending-1".to_owned()]);
        let d1 = decode_state(&st1).expect("decode");
        assert_eq!((d1.checkpoint, d1.shard, d1.files.len()), (1, 0, 1));
        w.commit(1).expect("commit 1");
        assert_eq!(visible_lines(&dir), a);
        assert!(hidden(&dir).is_empty());

        // Two checkpoints before one commit: the later commit publishes both.
        let b = lines("b", 0..10);
        let c = lines("c", 0..10);
        write_all(&mut *w, &b);
        let st2 = w.pre_commit(2).expect("pre-commit 2");
        write_all(&mut *w, &c);
        let st3 = w.pre_commit(3).expect("pre-commit 3");
        assert_eq!(decode_state(&st2).expect("decode").files.len(), 1);
        assert_eq!(
            decode_state(&st3).expect("decode").files.len(),
            2,
            "checkpoint 3 lists checkpoint 2's uncommitted file too"
        );
        assert_eq!(visible_lines(&dir), a);
        // Committing 2 must not publish what 3 prepared.
        w.commit(2).expect("commit 2");
        assert_eq!(visible_lines(&dir), [a.clone(), b.clone()].concat());
        w.commit(3).expect("commit 3");
        w.commit(3).expect("commit is idempotent");
        w.commit(1).expect("an older commit is a no-op");
        let all: Vec<String> = [a, b, c].concat();
        assert_eq!(visible_lines(&dir), all);

        // Nothing written: no new file, an empty list.
        let before = names(&dir);
        let st4 = w.pre_commit(4).expect("pre-commit 4");
        assert!(decode_state(&st4).expect("decode").files.is_empty());
        w.commit(4).expect("commit 4");
        assert_eq!(names(&dir), before);
        assert_eq!(visible_lines(&dir), all);
    }

    #[test]
    fn rolls_to_a_new_part_past_the_size() {
        let tmp = tempfile::tempdir().expect("temp dir");
        let s = sink(tmp.path()).with_part_size_bytes(20);
        let mut w = writer(&s, 1);
        let a: Vec<String> = (0..25).map(|i| format!("l{i:04}")).collect(); // 6 bytes a line
        write_all(&mut *w, &a);
        let st = decode_state(&w.pre_commit(1).expect("pre-commit")).expect("decode");
        // A part is closed at its 4th line (24 >= 20 bytes); the last holds the 25th line.
        assert_eq!(st.files.len(), 7);
        assert!(st.files.iter().all(|f| f.size == 24 || f.size == 6));
        assert!(visible(tmp.path()).is_empty());
        w.commit(1).expect("commit");
        assert_eq!(visible(tmp.path()).len(), 7);
        for n in visible(tmp.path()) {
            let len = std::fs::metadata(tmp.path().join(&n)).expect("stat").len();
            assert!(len <= 24, "{n} has {len} bytes");
        }
        assert_eq!(visible_lines(tmp.path()), a);
    }

    #[test]
    fn large_output_goes_through_the_buffer_intact() {
        let tmp = tempfile::tempdir().expect("temp dir");
        let s = sink(tmp.path()).with_part_size_bytes(300_000);
        let mut w = writer(&s, 0);
        let a: Vec<String> = (0..2000).map(|i| format!("{i:0>299}")).collect();
        write_all(&mut *w, &a);
        w.pre_commit(1).expect("pre-commit");
        w.commit(1).expect("commit");
        assert_eq!(visible_lines(tmp.path()), a);
        assert_eq!(visible(tmp.path()).len(), 2);
    }

    /// The crash scenario of the brief, with the plain file system (nothing undone: every
    /// hidden file stays behind) and with a simulated power cut (unsynced data lost).
    #[test]
    fn restore_after_a_crash_publishes_checkpoint_output_exactly_once() {
        for power_cut in [false, true] {
            let tmp = tempfile::tempdir().expect("temp dir");
            let dir = tmp.path().to_owned();
            let faulty = FaultyFs::new(FaultConfig::default());
            let s = sink(&dir).with_part_size_bytes(64).with_fs(if power_cut {
                Arc::new(faulty.clone())
            } else {
                Arc::new(StdFs)
            });
            let a = lines("a", 0..20);
            let b = lines("b", 0..20);
            let c = lines("c", 0..20);
            let mut w = writer(&s, 0);
            write_all(&mut *w, &a);
            let st1 = w.pre_commit(1).expect("pre-commit 1");
            write_all(&mut *w, &b);
            let _st2 = w.pre_commit(2).expect("pre-commit 2");
            write_all(&mut *w, &c);
            // Now a rolled but not pre-committed part and a buffered in-progress one exist.
            drop(w);
            if power_cut {
                faulty.crash().expect("crash");
            }
            // Every name that survived the crash (pending of checkpoint 2 included, which
            // restore deletes) must never be used again.
            let before: HashSet<u64> = names(&dir)
                .iter()
                .filter_map(|n| parse_name(n).map(|(_, q, _)| q))
                .collect();
            assert!(!hidden(&dir).is_empty());
            assert!(visible(&dir).is_empty());

            let mut w = writer(&s, 0);
            w.restore(1, &st1).expect("restore 1");
            assert_eq!(visible_lines(&dir), a, "power cut {power_cut}");
            assert!(
                hidden(&dir).is_empty(),
                "after-checkpoint output is gone: {:?}",
                hidden(&dir)
            );
            // Restoring again (a retried recovery) changes nothing.
            w.restore(1, &st1).expect("restore again");
            assert_eq!(visible_lines(&dir), a);

            // Continue: new names never collide with any earlier one.
            let d = lines("d", 0..20);
            write_all(&mut *w, &d);
            let st3 = decode_state(&w.pre_commit(3).expect("pre-commit 3")).expect("decode");
            for f in &st3.files {
                assert!(!before.contains(&f.seq), "seq {} reused", f.seq);
            }
            w.commit(3).expect("commit 3");
            assert_eq!(visible_lines(&dir), [a.clone(), d].concat());
            assert!(hidden(&dir).is_empty());
        }
    }

    #[test]
    fn a_new_process_continues_sequence_numbers_from_the_directory() {
        let tmp = tempfile::tempdir().expect("temp dir");
        let s = sink(tmp.path());
        let mut w = writer(&s, 0);
        write_all(&mut *w, &lines("a", 0..3));
        w.finish().expect("finish");
        drop(w);
        // No restore (a job without checkpoints, started again): the next file is seq 1.
        let mut w = writer(&s, 0);
        write_all(&mut *w, &lines("b", 0..3));
        w.finish().expect("finish");
        assert_eq!(
            visible(tmp.path()),
            vec!["part-0-0.csv".to_owned(), "part-0-1.csv".to_owned()]
        );
        assert_eq!(
            visible_lines(tmp.path()),
            [lines("a", 0..3), lines("b", 0..3)].concat()
        );
    }

    #[test]
    fn restore_after_the_commit_already_happened_is_idempotent() {
        let tmp = tempfile::tempdir().expect("temp dir");
        let s = sink(tmp.path());
        let mut w = writer(&s, 0);
        let a = lines("a", 0..5);
        write_all(&mut *w, &a);
        let st1 = w.pre_commit(1).expect("pre-commit");
        w.commit(1).expect("commit");
        drop(w);
        let mut w = writer(&s, 0);
        w.restore(1, &st1)
            .expect("restore: final exists with the recorded size");
        w.restore(1, &st1).expect("twice");
        assert_eq!(visible_lines(tmp.path()), a);
        assert!(hidden(tmp.path()).is_empty());
    }

    #[test]
    fn restore_fails_naming_a_vanished_or_altered_file() {
        let tmp = tempfile::tempdir().expect("temp dir");
        let s = sink(tmp.path());
        let mut w = writer(&s, 0);
        write_all(&mut *w, &lines("a", 0..5));
        let st1 = w.pre_commit(1).expect("pre-commit");
        drop(w);
        let pending = tmp.path().join(".part-0-0.pending-1");

        // Corrupted pending file: not published.
        let mut bytes = std::fs::read(&pending).expect("read");
        bytes[0] ^= 1;
        std::fs::write(&pending, &bytes).expect("corrupt");
        let mut w = writer(&s, 0);
        let err = w.restore(1, &st1).expect_err("CRC mismatch");
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
        assert!(err.to_string().contains(".part-0-0.pending-1"), "{err}");
        assert!(visible(tmp.path()).is_empty());
        // The failed writer refuses work until a restore succeeds.
        assert!(w.write("x".to_owned(), 0).is_err());

        // Gone altogether.
        std::fs::remove_file(&pending).expect("remove");
        let mut w = writer(&s, 0);
        let err = w.restore(1, &st1).expect_err("vanished");
        assert_eq!(err.kind(), io::ErrorKind::NotFound);
        let msg = err.to_string();
        assert!(
            msg.contains("part-0-0.csv") && msg.contains(".part-0-0.pending-1"),
            "{msg}"
        );

        // Published, but with another size.
        std::fs::write(tmp.path().join("part-0-0.csv"), "short\n").expect("write");
        let err = w.restore(1, &st1).expect_err("wrong size");
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
        assert!(err.to_string().contains("part-0-0.csv"), "{err}");
    }

    #[test]
    fn corrupt_or_truncated_state_is_invalid_data() {
        let tmp = tempfile::tempdir().expect("temp dir");
        let s = sink(tmp.path()).with_part_size_bytes(1);
        let mut w = writer(&s, 0);
        write_all(&mut *w, &lines("a", 0..4));
        let st = w.pre_commit(1).expect("pre-commit");
        assert_eq!(decode_state(&st).expect("decode").files.len(), 4);
        drop(w);
        let check = |bytes: &[u8], what: &str| {
            let err = decode_state(bytes).expect_err(what);
            assert_eq!(err.kind(), io::ErrorKind::InvalidData, "{what}: {err}");
            let mut w = writer(&s, 0);
            let err = w.restore(1, bytes).expect_err(what);
            assert_eq!(err.kind(), io::ErrorKind::InvalidData, "{what}: {err}");
        };
        for len in 1..st.len() {
            check(&st[..len], &format!("truncated to {len}"));
        }
        for bit in 0..st.len() * 8 {
            let mut b = st.clone();
            b[bit / 8] ^= 1 << (bit % 8);
            check(&b, &format!("bit {bit} flipped"));
        }
        let mut longer = st.clone();
        longer.push(0);
        check(&longer, "trailing byte");
        check(b"garbage!", "garbage");

        // Consistent CRC but wrong content: each rule is checked.
        let good = decode_state(&st).expect("decode");
        let reencode = |f: &dyn Fn(&mut State)| {
            let mut s2 = State {
                checkpoint: good.checkpoint,
                shard: good.shard,
                next_seq: good.next_seq,
                dir: good.dir.clone(),
                files: good.files.clone(),
                others: good.others.clone(),
            };
            f(&mut s2);
            encode_state(&s2)
        };
        assert_eq!(
            good.others,
            Some(vec![]),
            "shard 0 of 2, no other index's files"
        );
        check(
            &reencode(&|s| s.others = Some(vec![(0, 1)])),
            "shard 0 among the others",
        );
        check(
            &reencode(&|s| s.others = Some(vec![(3, 1), (2, 1)])),
            "others not ascending",
        );
        check(
            &reencode(&|s| s.others = Some(vec![(2, 1), (2, 4)])),
            "an other index twice",
        );
        check(
            &reencode(&|s| {
                s.shard = 1;
                s.others = Some(vec![(2, 1)]);
            }),
            "others in another shard's description",
        );
        check(&reencode(&|s| s.next_seq = 2), "seq not below next_seq");
        check(
            &reencode(&|s| s.files[1].seq = s.files[0].seq),
            "repeated seq",
        );
        check(&reencode(&|s| s.files[0].checkpoint = 2), "from the future");
        check(
            &reencode(&|s| s.dir = Some(PathBuf::from("relative/out"))),
            "relative directory",
        );
        let mut bad_name = st.clone();
        // The entries follow the header and the directory.
        let entries = STATE_HEADER_LEN + 2 + path_bytes(good.dir.as_deref().expect("dir")).len();
        let at = entries + 28 + 2 + 1; // first byte after ".", inside "part"
        bad_name[at] = b'/';
        let body = bad_name.len() - 4;
        let crc = crc32(&[&bad_name[..body]]);
        bad_name[body..].copy_from_slice(&crc.to_le_bytes());
        let err = decode_state(&bad_name).expect_err("name");
        assert!(err.to_string().contains("pending name"), "{err}");
        // A description of another checkpoint than the one restored.
        let mut w = writer(&s, 0);
        let err = w.restore(2, &st).expect_err("checkpoint mismatch");
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
        // The intact state still restores.
        let mut w = writer(&s, 0);
        w.restore(1, &st).expect("restore");
        assert_eq!(visible_lines(tmp.path()), lines("a", 0..4));
    }

    /// A job restored into another output directory (from a savepoint) publishes the
    /// checkpoint's files where they were written, and writes its own output to its new
    /// directory only.
    #[test]
    fn a_restore_into_another_directory_publishes_where_the_files_were_written() {
        let tmp = tempfile::tempdir().expect("temp dir");
        let (old, new) = (tmp.path().join("old"), tmp.path().join("new"));
        let s_old = sink(&old).with_part_size_bytes(1);
        let mut w = writer(&s_old, 0);
        write_all(&mut *w, &lines("a", 0..3));
        let st = w.pre_commit(1).expect("pre-commit");
        // The process dies before checkpoint 1's commit: its files stay pending in `old`.
        drop(w);
        assert!(visible(&old).is_empty());
        let s_new = sink(&new);
        let mut w = writer(&s_new, 0);
        w.restore(1, &st).expect("restore into the new directory");
        assert_eq!(visible_lines(&old), lines("a", 0..3));
        assert!(visible(&new).is_empty());
        write_all(&mut *w, &lines("b", 0..2));
        w.pre_commit(2).expect("pre-commit");
        w.commit(2).expect("commit");
        assert_eq!(visible_lines(&new), lines("b", 0..2));
        assert_eq!(
            visible_lines(&old),
            lines("a", 0..3),
            "the old output is untouched"
        );
        // The same description restored where it was written is idempotent.
        writer(&s_old, 0).restore(1, &st).expect("restore in place");
        assert_eq!(visible_lines(&old), lines("a", 0..3));
    }

    /// Version 1 descriptions (no directory) still restore, into the restoring writer's own
    /// directory.
    #[test]
    fn version_1_descriptions_restore_in_the_writers_directory() {
        let tmp = tempfile::tempdir().expect("temp dir");
        let s = sink(tmp.path()).with_part_size_bytes(1);
        let mut w = writer(&s, 0);
        write_all(&mut *w, &lines("a", 0..2));
        let v3 = w.pre_commit(1).expect("pre-commit");
        drop(w);
        let resealed = |mut body: Vec<u8>, version: u8| {
            body[4] = version;
            let crc = crc32(&[&body]);
            body.extend_from_slice(&crc.to_le_bytes());
            body
        };
        // The same description as version 2 wrote it: no list of other shard indices (here
        // an empty one, its count the 4 bytes before the CRC).
        let v2 = resealed(v3[..v3.len() - STATE_TRAILER_LEN - 4].to_vec(), 2);
        let d2 = decode_state(&v2).expect("v2");
        assert_eq!((d2.others, d2.files.len()), (None, 2));
        // And as version 1 wrote it: no directory field either.
        let dir_len = usize::from(u16::from_le_bytes([
            v2[STATE_HEADER_LEN],
            v2[STATE_HEADER_LEN + 1],
        ]));
        let mut v1 = v2[..STATE_HEADER_LEN].to_vec();
        v1.extend_from_slice(&v2[STATE_HEADER_LEN + 2 + dir_len..v2.len() - STATE_TRAILER_LEN]);
        let v1 = resealed(v1, 1);
        assert_eq!(decode_state(&v1).expect("v1").dir, None);
        writer(&s, 0).restore(1, &v1).expect("restore v1");
        assert_eq!(visible_lines(tmp.path()), lines("a", 0..2));
        let v4 = resealed(v3[..v3.len() - STATE_TRAILER_LEN].to_vec(), 4);
        let err = decode_state(&v4).expect_err("unknown version");
        assert!(err.to_string().contains("unsupported version 4"), "{err}");
    }

    #[test]
    fn finish_without_checkpoints_publishes_everything() {
        let tmp = tempfile::tempdir().expect("temp dir");
        let s = sink(tmp.path()).with_part_size_bytes(50);
        let mut w = writer(&s, 2);
        let a = lines("a", 0..30);
        write_all(&mut *w, &a);
        assert!(visible(tmp.path()).is_empty());
        w.finish().expect("finish");
        assert_eq!(visible_lines(tmp.path()), a);
        assert!(hidden(tmp.path()).is_empty());
        let before = names(tmp.path());
        w.finish().expect("finish again");
        assert_eq!(names(tmp.path()), before);
    }

    #[test]
    fn finish_after_a_completed_checkpoint_is_a_no_op() {
        let tmp = tempfile::tempdir().expect("temp dir");
        // A fault-free FaultyFs, for its count of operations: finish must take none.
        let faulty = FaultyFs::new(FaultConfig::default());
        let s = sink(tmp.path()).with_fs(Arc::new(faulty.clone()));
        let mut w = writer(&s, 0);
        let a = lines("a", 0..5);
        write_all(&mut *w, &a);
        w.pre_commit(1).expect("pre-commit");
        w.commit(1).expect("commit");
        let (names_before, steps) = (names(tmp.path()), faulty.steps());
        w.finish().expect("finish");
        assert_eq!(faulty.steps(), steps, "finish did I/O");
        assert_eq!(names(tmp.path()), names_before);
        assert_eq!(visible_lines(tmp.path()), a);
    }

    #[test]
    fn finish_leaves_pre_committed_files_to_their_commit() {
        let tmp = tempfile::tempdir().expect("temp dir");
        let s = sink(tmp.path());
        let mut w = writer(&s, 0);
        write_all(&mut *w, &lines("a", 0..5));
        w.pre_commit(1).expect("pre-commit");
        w.finish().expect("finish");
        assert!(
            visible(tmp.path()).is_empty(),
            "checkpoint 1 not complete yet"
        );
        w.commit(1).expect("commit");
        assert_eq!(visible_lines(tmp.path()), lines("a", 0..5));
    }

    #[test]
    fn a_failed_fsync_fails_the_checkpoint_and_is_never_retried() {
        let tmp = tempfile::tempdir().expect("temp dir");
        let probe = FaultyFs::new(FaultConfig::default());
        // First run without faults to learn the step of pre-commit 2's fsync.
        let steps_before_pre_commit_2 = {
            let d = tmp.path().join("probe");
            let s = sink(&d).with_fs(Arc::new(probe.clone()));
            let mut w = writer(&s, 0);
            write_all(&mut *w, &lines("a", 0..5));
            w.pre_commit(1).expect("pre-commit");
            w.commit(1).expect("commit");
            write_all(&mut *w, &lines("b", 0..5));
            probe.steps()
        };
        // Steps of pre-commit 2: write the buffer, then fsync.
        let faulty = FaultyFs::new(FaultConfig {
            fail_sync_at_step: Some(steps_before_pre_commit_2 + 1),
            ..FaultConfig::default()
        });
        let dir = tmp.path().join("out");
        let s = sink(&dir).with_fs(Arc::new(faulty.clone()));
        let mut w = writer(&s, 0);
        write_all(&mut *w, &lines("a", 0..5));
        let st1 = w.pre_commit(1).expect("pre-commit 1");
        w.commit(1).expect("commit 1");
        write_all(&mut *w, &lines("b", 0..5));
        let err = w.pre_commit(2).expect_err("fsync fails");
        assert!(err.to_string().contains("fsync"), "{err}");
        assert!(w.pre_commit(3).is_err(), "no retry after a failed fsync");
        assert!(w.write("c".to_owned(), 0).is_err());
        assert!(w.finish().is_err());
        drop(w);
        faulty.crash().expect("crash");
        let mut w = writer(&s, 0);
        w.restore(1, &st1).expect("restore");
        assert_eq!(visible_lines(&dir), lines("a", 0..5));
        assert!(hidden(&dir).is_empty());
        write_all(&mut *w, &lines("b", 0..5));
        w.pre_commit(2).expect("pre-commit 2 again");
        w.commit(2).expect("commit 2");
        assert_eq!(
            visible_lines(&dir),
            [lines("a", 0..5), lines("b", 0..5)].concat()
        );
    }

    /// Power cut or failed operation at every step of a two-checkpoint run; afterwards the job
    /// restores from the last checkpoint whose pre-commit succeeded, and the visible output is
    /// exactly that checkpoint's lines.
    #[test]
    fn exactly_once_across_a_failure_at_every_step() {
        let batches = [lines("a", 0..12), lines("b", 0..12), lines("c", 0..12)];
        // A clean run first: how many steps there are to fail at.
        let (total, failed) = failure_case(u64::MAX, 3, &batches);
        assert!(total > 20 && !failed, "{total} steps");
        // How many runs each kind of fault really cut short: a sweep whose faults never
        // fired (the file system's steps out of step with the sink's operations) checks
        // nothing but clean runs.
        let mut fired = [0u32; 5];
        for step in 0..=total {
            for kind in 0..5 {
                if failure_case(step, kind, &batches).1 {
                    fired[kind as usize] += 1;
                }
            }
        }
        assert!(
            fired.iter().all(|&n| n > 0),
            "faults fired per kind: {fired:?}"
        );
    }

    /// Runs three checkpoints with a fault of `kind` at `step` (0: torn write, 1: failed
    /// fsync, 2: failed rename, 3: power cut between the sink's calls once `step` steps are
    /// taken, 4: power cut at the step itself, within a call, the file system dead from there
    /// on, so that the sink cannot clean up after itself), crashes, restores
    /// the newest checkpoint whose pre-commit succeeded and checks the visible output is
    /// exactly the lines up to it. Returns the steps taken before the crash, and whether the
    /// fault cut the run short (an operation failed, or the power cut came before the end).
    fn failure_case(step: u64, kind: u64, batches: &[Vec<String>; 3]) -> (u64, bool) {
        let tmp = tempfile::tempdir().expect("temp dir");
        let dir = tmp.path().to_owned();
        let faulty = FaultyFs::new(FaultConfig {
            seed: step.wrapping_mul(5) + kind,
            tear_write_at_step: (kind == 0).then_some(step),
            fail_sync_at_step: (kind == 1).then_some(step),
            fail_rename_at_step: (kind == 2).then_some(step),
            power_cut_at_step: (kind == 4).then_some(step),
            ..FaultConfig::default()
        });
        let s = sink(&dir)
            .with_part_size_bytes(40)
            .with_fs(Arc::new(faulty.clone()));
        let mut w = writer(&s, 0);
        // (checkpoint, its state, lines up to it), for completed pre-commits.
        let mut prepared: Vec<(u64, Vec<u8>, Vec<String>)> = Vec::new();
        let mut committed = 0u64;
        let mut expected: Vec<String> = Vec::new();
        let cut = |faulty: &FaultyFs| kind == 3 && faulty.steps() >= step;
        // Ok(true): the power cut came before the end.
        let run = (|| -> io::Result<bool> {
            for (n, batch) in (1u64..).zip(batches.iter()) {
                for l in batch {
                    if cut(&faulty) {
                        return Ok(true);
                    }
                    w.write(l.clone(), 0)?;
                }
                expected.extend(batch.iter().cloned());
                let st = w.pre_commit(n)?;
                prepared.push((n, st, expected.clone()));
                if cut(&faulty) {
                    return Ok(true);
                }
                w.commit(n)?;
                committed = n;
            }
            Ok(false)
        })();
        // A failed run is the point of the test; what matters is the restore below.
        let failed = match run {
            Ok(cut_short) => cut_short || faulty.power_is_cut(),
            Err(e) => {
                eprintln!("step {step} kind {kind}: run failed as injected: {e}");
                true
            }
        };
        let steps = faulty.steps();
        drop(w);
        faulty.crash().expect("crash");
        // The coordinator restores the newest checkpoint that completed (its pre-commit
        // succeeded); commits after it may or may not have happened.
        let Some((n, st, want)) = prepared.last() else {
            assert!(visible(&dir).is_empty(), "step {step} kind {kind}");
            return (steps, failed);
        };
        assert!(committed <= *n);
        let mut w = writer(&s, 0);
        w.restore(*n, st)
            .unwrap_or_else(|e| panic!("step {step} kind {kind}: restore: {e}"));
        assert_eq!(&visible_lines(&dir), want, "step {step} kind {kind}");
        assert!(hidden(&dir).is_empty(), "step {step} kind {kind}");
        if step == u64::MAX {
            assert_eq!(want.len(), 36, "the clean run prepares everything");
        }
        (steps, failed)
    }

    /// A restore of a checkpoint older than output committed since, into the same directory,
    /// is refused before it changes anything (it published and replayed, leaving the later
    /// output's records there twice); allowed, it goes on.
    #[test]
    fn restoring_behind_committed_output_is_refused_unless_allowed() {
        let tmp = tempfile::tempdir().expect("temp dir");
        let dir = tmp.path().to_owned();
        let s = sink(&dir);
        let mut w = writer(&s, 0);
        write_all(&mut *w, &lines("a", 0..3));
        let at_1 = w.pre_commit(1).expect("pre-commit 1");
        write_all(&mut *w, &lines("b", 0..3));
        let at_2 = w.pre_commit(2).expect("pre-commit 2");
        w.commit(2).expect("commit 2");
        write_all(&mut *w, &lines("c", 0..3));
        w.pre_commit(3).expect("pre-commit 3");
        drop(w);
        let before = names(&dir);

        let mut w = writer(&s, 0);
        let e = w.restore(1, &at_1).expect_err("behind part-0-1.csv");
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
        let msg = e.to_string();
        assert!(
            msg.contains(&final_name(0, 1)) && msg.contains("after checkpoint 1"),
            "{msg}"
        );
        assert_eq!(names(&dir), before, "nothing changed");
        // The newest complete checkpoint is fine.
        drop(w);
        let mut w = writer(&s, 0);
        w.restore(2, &at_2).expect("restore 2");
        assert_eq!(
            visible_lines(&dir),
            [lines("a", 0..3), lines("b", 0..3)].concat()
        );
        drop(w);
        // Allowed: the older one restores, and its replay will write b's records again.
        let mut w = writer(&s, 0);
        w.allow_rewind(true);
        w.restore(1, &at_1).expect("allowed");
    }

    /// A checkpoint of 2 shards, then the job scaled up to 3, which committed part files of
    /// index 2: restoring the checkpoint again would write their records twice, and is
    /// refused before anything changes (shard 0's description records the other indices'
    /// files, none here). Files of an index from an earlier run scaled down before the
    /// checkpoint are recorded, and pass.
    #[test]
    fn restoring_behind_output_of_shard_indices_added_since_is_refused() {
        let tmp = tempfile::tempdir().expect("temp dir");
        let dir = tmp.path().to_owned();
        let s = sink(&dir);
        // An earlier run on 3 shards: index 2 commits part-2-0.csv.
        let mut w2 = writer_of(&s, 2, 3);
        write_all(&mut *w2, &lines("old", 0..2));
        w2.pre_commit(1).expect("pre-commit");
        w2.commit(1).expect("commit");
        drop(w2);
        // Scaled down to 2 shards: checkpoint 2.
        let (mut w0, mut w1) = (writer(&s, 0), writer(&s, 1));
        write_all(&mut *w0, &lines("a", 0..2));
        let d0 = w0.pre_commit(2).expect("pre-commit");
        let d1 = w1.pre_commit(2).expect("pre-commit");
        w0.commit(2).expect("commit");
        w1.commit(2).expect("commit");
        drop((w0, w1));
        assert_eq!(decode_state(&d0).expect("d0").others, Some(vec![(2, 1)]));
        // Restorable: part-2-0.csv was there before the checkpoint.
        writer(&s, 0)
            .check_restore(2, &[&d0, &d1])
            .expect("the earlier run's files pass");
        // Scaled up again to 3 shards after checkpoint 2: index 2 commits part-2-1.csv.
        let mut w2 = writer_of(&s, 2, 3);
        write_all(&mut *w2, &lines("new", 0..2));
        w2.pre_commit(3).expect("pre-commit");
        w2.commit(3).expect("commit");
        drop(w2);
        let before = names(&dir);
        for shards in [2, 3] {
            let e = writer_of(&s, 0, shards)
                .check_restore(2, &[&d0, &d1])
                .expect_err("behind part-2-1.csv");
            assert_eq!(e.kind(), io::ErrorKind::InvalidData);
            let msg = e.to_string();
            assert!(
                msg.contains(&final_name(2, 1)) && msg.contains("after checkpoint 2"),
                "{msg}"
            );
        }
        assert_eq!(names(&dir), before, "nothing changed");
        let mut w = writer(&s, 0);
        w.allow_rewind(true);
        w.check_restore(2, &[&d0, &d1]).expect("allowed");
    }

    /// Shard 0's record leaves out the earlier runs' files that its first commit removes (a
    /// run from the beginning replaces them), and a record taken in another directory says
    /// nothing of the restoring writer's: there, a file of an index the checkpoint did not
    /// have is output of an earlier restore of the same checkpoint.
    #[test]
    fn the_other_indices_record_leaves_out_replaced_files_and_other_directories() {
        let tmp = tempfile::tempdir().expect("temp dir");
        let (x, y) = (tmp.path().join("x"), tmp.path().join("y"));
        std::fs::create_dir_all(&x).expect("mkdir");
        // Index 3 of earlier runs: part-3-5.csv stays, part-3-21.csv is replaced.
        let (kept, old) = (x.join(final_name(3, 5)), x.join(final_name(3, 21)));
        for f in [&kept, &old] {
            std::fs::write(f, "old\n").expect("write");
        }
        let sx = sink(&x).replacing(vec![old.clone()]);
        let (mut w0, mut w1) = (writer(&sx, 0), writer(&sx, 1));
        write_all(&mut *w0, &lines("a", 0..2));
        let d0 = w0.pre_commit(1).expect("pre-commit");
        let d1 = w1.pre_commit(1).expect("pre-commit");
        assert_eq!(decode_state(&d0).expect("d0").others, Some(vec![(3, 6)]));
        w0.commit(1).expect("commit");
        w1.commit(1).expect("commit");
        assert!(!old.exists(), "replaced at the first commit");
        drop((w0, w1, sx));
        // Restored into y on 4 shards: index 3 commits part-3-0.csv there.
        let sy = sink(&y);
        let mut w3 = writer_of(&sy, 3, 4);
        writer_of(&sy, 0, 4)
            .check_restore(1, &[&d0, &d1])
            .expect("y is empty");
        write_all(&mut *w3, &lines("b", 0..2));
        w3.pre_commit(2).expect("pre-commit");
        w3.commit(2).expect("commit");
        drop(w3);
        // The same checkpoint again, into y: part-3-0.csv would be written twice (x's record
        // would let it pass: 0 < 6).
        let e = writer_of(&sy, 0, 2)
            .check_restore(1, &[&d0, &d1])
            .expect_err("behind part-3-0.csv");
        assert!(e.to_string().contains(&final_name(3, 0)), "{e}");
        // And into x, where index 3 has nothing past the record (part-3-5.csv is older).
        writer_of(&sink(&x), 0, 2)
            .check_restore(1, &[&d0, &d1])
            .expect("x has nothing of index 3");
    }

    /// Restored into another directory (a savepoint's into a new output), the same restore
    /// again is refused once the first one's output is committed there: it was accepted, and
    /// every restore of it added the records after the savepoint once more.
    #[test]
    fn restoring_the_same_checkpoint_into_another_directory_twice_is_refused() {
        let tmp = tempfile::tempdir().expect("temp dir");
        let (x, y) = (tmp.path().join("x"), tmp.path().join("y"));
        let sx = sink(&x);
        let mut w = writer(&sx, 0);
        write_all(&mut *w, &lines("a", 0..3));
        let at_1 = w.pre_commit(1).expect("pre-commit");
        drop((w, sx));
        let sy = sink(&y);
        let mut w = writer(&sy, 0);
        w.restore(1, &at_1).expect("first restore into y");
        write_all(&mut *w, &lines("b", 0..3));
        w.pre_commit(2).expect("pre-commit 2");
        w.commit(2).expect("commit 2");
        drop(w);
        let before = names(&y);
        let mut w = writer(&sy, 0);
        let e = w.restore(1, &at_1).expect_err("again");
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
        assert!(e.to_string().contains(&final_name(0, 1)), "{e}");
        assert_eq!(names(&y), before);
    }

    /// Every shard checks every old shard's description before any restores: one shard whose
    /// own description passed went on (publishing and deleting) while another refused.
    #[test]
    fn a_refused_restore_is_refused_on_every_shard_first() {
        let tmp = tempfile::tempdir().expect("temp dir");
        let dir = tmp.path().to_owned();
        let s = sink(&dir);
        let (mut w0, mut w1) = (writer(&s, 0), writer(&s, 1));
        write_all(&mut *w0, &lines("a", 0..3));
        write_all(&mut *w1, &lines("b", 0..3));
        let states = [
            w0.pre_commit(1).expect("pre-commit"),
            w1.pre_commit(1).expect("pre-commit"),
        ];
        // Only shard 1 commits output after checkpoint 1.
        write_all(&mut *w1, &lines("c", 0..3));
        w0.pre_commit(2).expect("pre-commit 2");
        w1.pre_commit(2).expect("pre-commit 2");
        w1.commit(2).expect("commit 2");
        drop((w0, w1));
        let before = names(&dir);
        let all: Vec<&[u8]> = states.iter().map(Vec::as_slice).collect();
        let mut w0 = writer(&s, 0);
        let e = w0.check_restore(1, &all).expect_err("shard 1's output");
        assert!(e.to_string().contains(&final_name(1, 1)), "{e}");
        assert_eq!(names(&dir), before, "nothing changed");
        w0.allow_rewind(true);
        w0.check_restore(1, &all).expect("allowed");
    }

    /// Restored onto fewer shards, a writer handed the description of an old shard index
    /// that no longer runs cleans up that index's hidden files as its own (before, they stayed
    /// in the directory for good); another live shard's files stay that shard's.
    #[test]
    fn restored_onto_fewer_shards_the_old_indices_are_cleaned_by_their_heir() {
        let tmp = tempfile::tempdir().expect("temp dir");
        let dir = tmp.path().to_owned();
        let s = sink(&dir);
        let mut ws: Vec<_> = (0..3).map(|i| writer_of(&s, i, 3)).collect();
        let mut states = Vec::new();
        for (i, w) in ws.iter_mut().enumerate() {
            write_all(&mut **w, &lines(&format!("s{i}"), 0..4));
            states.push(w.pre_commit(1).expect("pre-commit"));
            write_all(&mut **w, &lines(&format!("late{i}"), 0..2));
            w.pre_commit(2).expect("pre-commit 2");
            write_all(&mut **w, &lines(&format!("later{i}"), 0..2));
        }
        drop(ws);
        // Two shards now: shard 0 takes old shards 0 and 2, shard 1 takes old shard 1.
        let mut w0 = writer_of(&s, 0, 2);
        w0.restore(1, &states[0]).expect("restore");
        w0.restore(1, &states[2]).expect("restore");
        // Old shard 2's after-checkpoint files are gone; shard 1's wait for its own writer.
        assert_eq!(
            hidden(&dir),
            [
                ".part-1-0.pending-1",
                ".part-1-1.pending-2",
                ".part-1-2.inprogress"
            ]
            .map(String::from)
        );
        let mut w1 = writer_of(&s, 1, 2);
        w1.restore(1, &states[1]).expect("restore");
        assert!(hidden(&dir).is_empty(), "{:?}", hidden(&dir));
        let mut want = [lines("s0", 0..4), lines("s1", 0..4), lines("s2", 0..4)].concat();
        want.sort();
        let mut got = visible_lines(&dir);
        got.sort();
        assert_eq!(got, want);
    }

    #[test]
    fn rescaled_restore_publishes_other_shards_and_cleans_only_its_own() {
        for order in [[0usize, 1], [1, 0]] {
            let tmp = tempfile::tempdir().expect("temp dir");
            let dir = tmp.path().to_owned();
            let s = sink(&dir);
            let mut w0 = writer(&s, 0);
            let mut w1 = writer(&s, 1);
            write_all(&mut *w0, &lines("s0", 0..5));
            write_all(&mut *w1, &lines("s1", 0..5));
            let states = [
                w0.pre_commit(1).expect("pre-commit"),
                w1.pre_commit(1).expect("pre-commit"),
            ];
            write_all(&mut *w0, &lines("late0", 0..2));
            write_all(&mut *w1, &lines("late1", 0..2));
            w0.pre_commit(2).expect("pre-commit 2");
            w1.pre_commit(2).expect("pre-commit 2");
            drop((w0, w1));

            // One shard now: it gets both descriptions.
            let mut w = writer(&s, 0);
            for i in order {
                w.restore(1, &states[i]).expect("restore");
            }
            assert_eq!(
                visible_lines(&dir),
                [lines("s0", 0..5), lines("s1", 0..5)].concat()
            );
            // Shard 0's after-checkpoint file is gone; shard 1's is not shard 0's to delete.
            assert_eq!(hidden(&dir), vec![".part-1-1.pending-2".to_owned()]);
        }
    }

    #[test]
    fn restore_without_a_description_still_cleans_up() {
        let tmp = tempfile::tempdir().expect("temp dir");
        let s = sink(tmp.path());
        let mut w = writer(&s, 0);
        write_all(&mut *w, &lines("a", 0..3));
        w.pre_commit(5).expect("pre-commit");
        write_all(&mut *w, &lines("b", 0..3));
        w.finish().expect("finish"); // publishes b only
        write_all(&mut *w, &lines("c", 0..3));
        drop(w);
        let mut w = writer(&s, 0);
        w.restore(4, &[]).expect("restore");
        assert!(hidden(tmp.path()).is_empty(), "{:?}", hidden(tmp.path()));
        assert_eq!(visible_lines(tmp.path()), lines("b", 0..3));
    }
}
