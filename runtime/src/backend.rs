//! A keyed operator's state on one shard: its own LSM store ([`weir_state::KeyedBackend`])
//! under `<state-dir>/shard-<n>/<operator>`, and the background thread that runs the store's
//! flushes, compactions and the asynchronous part of its snapshots.
//!
//! Processing never waits for state I/O (DESIGN invariant 5): a full memtable is frozen in
//! place, a snapshot only seals it (microseconds, copy-on-write after), and writing segments,
//! compacting and uploading a snapshot's new segments to checkpoint storage run as `Send` jobs
//! on the maintenance thread; the shard installs their results between two steps of its loop.

use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Instant;

use weir_io::Fs;
use weir_state::{JobDone, KeyGroupRange, KeyedBackend, SnapshotHandle, Store, StoreConfig};

use crate::checkpoint::shard::ShardCheckpointRef;
use crate::checkpoint::snapshot::{FileRefData, Part, PartKind};
use crate::data::Data;
use crate::error::{JobError, StartError};
use crate::graph::BuildCtx;

pub use weir_state::StateError;

/// A registered state (operator uid and state name), by the id the store derived from its
/// name: typed handles are built from it without hashing the name per access.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct StateId(pub u16);

/// A snapshot's part, the segments it uploaded (with their files) and those it reused.
type SnapshotUploads = (Part, Vec<(u64, FileRefData)>, Vec<u64>);

enum Output {
    Maintenance(JobDone),
    Snapshot {
        checkpoint_id: u64,
        /// The part, the segments it uploaded and the segments it reused.
        result: Result<SnapshotUploads, String>,
        elapsed_ns: u64,
    },
}

/// A flush or compaction, given a hook to call every few milliseconds (see `serve`); the job
/// stops early when the hook breaks.
type MaintenanceJob = Box<dyn FnOnce(&mut dyn FnMut() -> ControlFlow<()>) -> Output + Send>;

/// A store's flush or compaction (`run`: its `run_yielding`) as a [`MaintenanceJob`].
fn maintenance_job<D: Into<JobDone>>(
    run: impl FnOnce(&mut dyn FnMut() -> ControlFlow<()>) -> D + Send + 'static,
) -> MaintenanceJob {
    Box::new(move |y| Output::Maintenance(run(y).into()))
}

/// Work for a store's maintenance thread.
enum Job {
    /// Runs at the next yield of a compaction in progress (see `serve`).
    Flush(MaintenanceJob),
    Compaction(MaintenanceJob),
    /// A snapshot's asynchronous part: runs at the next yield of any job in progress.
    Snapshot(Box<dyn FnOnce() -> Output + Send>),
}

struct Maintenance {
    jobs: mpsc::Sender<Job>,
    done: mpsc::Receiver<Output>,
    snapshots_in_flight: usize,
    /// Set when the store goes away: queued jobs are dropped, not run.
    cancel: Arc<AtomicBool>,
}

struct Inner {
    be: KeyedBackend,
    shard: usize,
    operator: String,
    maint: Option<Maintenance>,
    checkpoint: Option<ShardCheckpointRef>,
    /// Segments of this store already in checkpoint storage, by segment id, with the
    /// checkpoint that uploaded them and the last one that referenced them (reused them or
    /// uploaded them): a file is reused while either is a recent complete checkpoint. With
    /// the uploader alone, every segment was uploaded again once its uploader fell out of the
    /// recent completed ids, every 64 checkpoints.
    uploaded: HashMap<u64, (FileRefData, u64, u64)>,
    /// Timers of the restored checkpoint, for the operator to take.
    restored_timers: Vec<Vec<u8>>,
    /// The store's figures in the job's metrics, updated when background work is installed.
    counters: Arc<crate::metrics::StateCounters>,
}

/// Copies the store's figures into the job's metrics.
fn publish_metrics(be: &KeyedBackend, c: &crate::metrics::StateCounters) {
    let m = be.store().metrics();
    c.flushes.store(m.flushes, Ordering::Relaxed);
    c.compactions.store(m.compactions, Ordering::Relaxed);
    c.segments.store(m.segments as u64, Ordering::Relaxed);
    c.segment_bytes.store(m.segment_bytes, Ordering::Relaxed);
    c.memtable_bytes
        .store(m.memtable_bytes as u64, Ordering::Relaxed);
}

impl Drop for Inner {
    /// Does not wait for the maintenance thread: after a failure the restart must not wait for
    /// queued compactions and uploads of an attempt that is over (seconds with large state).
    /// The thread skips what is queued, stops a flush or compaction it is running at that
    /// job's next yield (a snapshot job it finishes), removes this store's run directory and
    /// exits; the next attempt works in a directory of its own.
    fn drop(&mut self) {
        if let Some(m) = self.maint.take() {
            m.cancel.store(true, Ordering::Release);
        }
    }
}

/// Distinguishes the run directories of the stores this process opens.
static RUNS: AtomicU64 = AtomicU64::new(0);

/// The maintenance threads of a job that are still alive. A failed attempt does not wait for
/// its threads (see `Inner`'s drop), but [`crate::JobHandle::wait`] does: a thread finishing a
/// snapshot job holds a checkpoint writer, and with it the checkpoint directory's lock, so
/// that a job started on the same directory right after `wait` returned was refused as
/// "locked by another owner"; and it removes its run directory only as it exits.
#[derive(Debug, Default)]
pub(crate) struct MaintenanceThreads {
    live: std::sync::Mutex<usize>,
    gone: std::sync::Condvar,
}

/// One live maintenance thread, counted until dropped.
pub(crate) struct LiveThread(Arc<MaintenanceThreads>);

impl MaintenanceThreads {
    fn enter(self: &Arc<Self>) -> LiveThread {
        *self.live.lock().unwrap_or_else(|p| p.into_inner()) += 1;
        LiveThread(self.clone())
    }

    /// Blocks until every thread counted so far has exited.
    pub(crate) fn wait_all(&self) {
        let mut live = self.live.lock().unwrap_or_else(|p| p.into_inner());
        while *live > 0 {
            live = self.gone.wait(live).unwrap_or_else(|p| p.into_inner());
        }
    }
}

impl Drop for LiveThread {
    fn drop(&mut self) {
        let mut live = self.0.live.lock().unwrap_or_else(|p| p.into_inner());
        *live -= 1;
        if *live == 0 {
            self.0.gone.notify_all();
        }
    }
}

/// Removes what earlier processes left in an operator's state directory: run directories
/// whose owner died (their lock is free) and files of older layouts. Run directories of this
/// process are left alone: a finishing maintenance thread removes its own.
fn remove_stale_runs(op_dir: &Path) {
    let Ok(entries) = std::fs::read_dir(op_dir) else {
        return;
    };
    let own = format!("run-{}-", std::process::id());
    for e in entries.flatten() {
        let path = e.path();
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with(&own) {
            continue;
        }
        if !path.is_dir() {
            let _ = std::fs::remove_file(&path);
        } else if let Ok(lock) = weir_io::DirLock::acquire(&path) {
            let _ = std::fs::remove_dir_all(&path);
            drop(lock);
        }
    }
}

/// The keyed state of one operator on one shard.
#[derive(Clone)]
pub struct ShardState {
    inner: Rc<RefCell<Inner>>,
}

/// What a keyed operator's checkpoint part holds inline.
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Debug)]
pub(crate) struct KeyedPart {
    /// `weir_state::SnapshotHandle::to_bytes`.
    pub handle: Vec<u8>,
    /// Which uploaded file holds each segment of the handle.
    pub segments: Vec<(u64, FileRefData)>,
    /// The operator's timers (its own encoding).
    pub timers: Vec<u8>,
}

/// What a keyed operator's `state-types` part holds: per state its id, name, and kind and
/// value type (`weir_state::KeyedBackend::state_types`).
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Debug, Default, PartialEq, Eq)]
pub(crate) struct StateTypesPart {
    pub types: Vec<(u16, String, String)>,
}

fn sanitize(name: &str) -> String {
    name.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// The configuration of every keyed operator's store in a job configured by `config`.
fn store_config(config: &crate::config::JobConfig) -> StoreConfig {
    StoreConfig {
        memtable_budget_bytes: config.memtable_budget_bytes,
        retained_memtable_bytes: config.retained_memtable_bytes,
        prefault_memtable: config.prefault_state_memory,
        max_parallelism: config.max_parallelism,
        ..StoreConfig::default()
    }
}

/// Whether a restore that failed to take a checkpoint file may pass on a restart: an I/O
/// fault may, a file gone may not. Every restart met a missing file again (a `weir
/// checkpoints clean` beside a `--restore` of its checkpoint restarted the job forever): the
/// checkpoint is damaged, as when a file is missing before the restore begins.
fn may_pass(e: &weir_io::CheckpointError) -> bool {
    match e {
        weir_io::CheckpointError::Io(weir_io::IoError::Os { source, .. }) => {
            source.kind() != std::io::ErrorKind::NotFound
        }
        weir_io::CheckpointError::Io(_) => true,
        _ => false,
    }
}

impl ShardState {
    /// Opens (or restores) the store of operator `name` on the shard `ctx` builds.
    pub(crate) fn open_for(ctx: &BuildCtx, name: &str) -> Result<Self, StartError> {
        let shard = ctx.shard;
        let err = |reason: String| StartError::State { shard, reason };
        // I/O errors: a restart may pass them (a failover's restore is retried).
        let io_err = |reason: String| StartError::StateIo { shard, reason };
        let op_dir = ctx
            .state_dir
            .join(format!("shard-{shard}"))
            .join(sanitize(name));
        remove_stale_runs(&op_dir);
        // A fresh directory per store: a restore rebuilds the store from the checkpoint, state
        // left by an earlier attempt must not leak into this one, and that attempt's
        // maintenance thread may still be finishing a job in its own directory.
        let dir = op_dir.join(format!(
            "run-{}-{}",
            std::process::id(),
            RUNS.fetch_add(1, Ordering::Relaxed)
        ));
        let fs: Arc<dyn Fs> =
            match &ctx.config.state_fs {
                Some(fs) => fs.clone(),
                None if ctx.real_io => Arc::new(weir_io::UringFs::new().map_err(|e| {
                    StartError::IoUringUnavailable {
                        reason: e.to_string(),
                    }
                })?),
                None => Arc::new(weir_io::StdFs),
            };
        let config = &ctx.config;
        let store_config = store_config(config);
        let range =
            KeyGroupRange::for_shard(shard as u16, config.shards as u16, config.max_parallelism);
        if dir.exists() {
            std::fs::remove_dir_all(&dir).map_err(|e| err(format!("{}: {e}", dir.display())))?;
        }
        let mut restored_timers = Vec::new();
        let mut restored_types = Vec::new();
        // Restored segments the store keeps as they are, by local path: (segment id, the
        // checkpoint file it is a link to or a copy of).
        let mut linked: HashMap<PathBuf, (u64, FileRefData)> = HashMap::new();
        let store = match ctx.restore.as_ref() {
            Some(r) => {
                let mut handles = Vec::new();
                let local = dir.join("restore");
                std::fs::create_dir_all(&local)
                    .map_err(|e| err(format!("{}: {e}", local.display())))?;
                // A failed restore leaves none of its links or copies (scratch) behind.
                let mut scratch = RemoveOnDrop(Some(local.clone()));
                // Every old shard's record of its states' types (checkpoints written before
                // they were recorded have none: nothing is checked then).
                for (_, part) in r.parts(name, PartKind::StateTypes) {
                    let t: StateTypesPart = crate::checkpoint::snapshot::decode_any(&part.bytes)
                        .map_err(|e| {
                            err(format!(
                                "checkpoint {}: state types of `{name}`: {e}",
                                r.checkpoint_id
                            ))
                        })?;
                    restored_types.extend(t.types);
                }
                for (_, part) in r.parts(name, PartKind::Keyed) {
                    let mut kp: KeyedPart = crate::checkpoint::snapshot::decode_any(&part.bytes)
                        .map_err(|e| {
                            err(format!(
                                "checkpoint {}: state of `{name}`: {e}",
                                r.checkpoint_id
                            ))
                        })?;
                    let mut h = SnapshotHandle::from_bytes(&kp.handle).map_err(|e| {
                        err(format!(
                            "checkpoint {}: state handle of `{name}`: {e}",
                            r.checkpoint_id
                        ))
                    })?;
                    // Timers first, from every part: a part's timers are not bounded by its
                    // segments' key groups (a key may have timers and no state, and an
                    // operator with timers only has no segments at all), and
                    // `TimerQueues::restored` keeps those of this shard's key groups. Taken
                    // only with a segment in range, such timers were lost on every restore.
                    restored_timers.push(std::mem::take(&mut kp.timers));
                    if h.segments
                        .iter()
                        .all(|s| s.key_groups.is_some_and(|g| !g.intersects(&range)))
                    {
                        continue;
                    }
                    let files: HashMap<u64, &FileRefData> =
                        kp.segments.iter().map(|(id, f)| (*id, f)).collect();
                    for seg in &mut h.segments {
                        // Only what the range needs leaves checkpoint storage.
                        if !seg.key_groups.is_some_and(|g| g.intersects(&range)) {
                            continue;
                        }
                        let f = files.get(&seg.segment_id).ok_or_else(|| {
                            err(format!(
                                "checkpoint {}: segment {} of `{name}` has no file",
                                r.checkpoint_id, seg.segment_id
                            ))
                        })?;
                        let path =
                            local.join(format!("{}-{:016x}.wseg", handles.len(), seg.segment_id));
                        // Verified before the store trusts a byte (invariant 4). The whole
                        // checkpoint verified before this restore began. A raw upload (the
                        // default) becomes a hard link, not read again here: the store maps
                        // the checkpoint's bytes, which nothing writes again, and checks every
                        // block, then size and whole-file CRC against the handle, which must
                        // be the file's own reference (checked here). Reading it here as well
                        // cost a third pass over the restored state (~0.4 s a GiB). A framed
                        // upload is copied in a pass that checks its blocks.
                        if (f.size_bytes, f.crc32) != (seg.size_bytes, seg.crc32) {
                            return Err(err(format!(
                                "checkpoint {}: segment {} of `{name}`: the checkpoint lists its file {} as {} bytes with CRC {:#010x}, its state handle as {} bytes with CRC {:#010x}",
                                r.checkpoint_id,
                                seg.segment_id,
                                r.reader.path_of(f).display(),
                                f.size_bytes,
                                f.crc32,
                                seg.size_bytes,
                                seg.crc32
                            )));
                        }
                        r.reader.link_file_to(f, &path).map_err(|e| {
                            let io = may_pass(&e);
                            let reason = format!(
                                "checkpoint {}: segment {} of `{name}`: {e}",
                                r.checkpoint_id, seg.segment_id
                            );
                            if io {
                                io_err(reason)
                            } else {
                                err(reason)
                            }
                        })?;
                        linked.insert(path.clone(), (seg.segment_id, (*f).clone()));
                        seg.path = path;
                    }
                    handles.push(h);
                }
                tracing::debug!(
                    "restore {name} shard {shard}: {} handles, ckpt {}, parts {}",
                    handles.len(),
                    r.checkpoint_id,
                    r.parts(name, PartKind::Keyed).count()
                );
                // The copies are this store's own: it deletes them once compaction replaced them.
                let (store, report) =
                    Store::restore_adopting(fs, &dir, store_config, &handles, range).map_err(
                        |e| {
                            // The store names its link of a segment; say which checkpoint
                            // file that is.
                            let of = named_file(&e)
                                .and_then(|p| linked.get(p))
                                .map(|(_, f)| {
                                    format!(" (checkpoint file {})", r.reader.path_of(f).display())
                                })
                                .unwrap_or_default();
                            let reason = format!(
                                "restoring `{name}` from checkpoint {}: {e}{of}",
                                r.checkpoint_id
                            );
                            if matches!(e, StateError::Io(_)) {
                                io_err(reason)
                            } else {
                                err(reason)
                            }
                        },
                    )?;
                tracing::debug!("restore {name} shard {shard}: {report:?}");
                // The store owns what it kept of them now.
                scratch.0 = None;
                store
            }
            None => Store::open(fs, &dir, store_config).map_err(|e| {
                let reason = format!("{}: {e}", dir.display());
                if matches!(e, StateError::Io(_)) {
                    io_err(reason)
                } else {
                    err(reason)
                }
            })?,
        };
        // A segment the store kept from a checkpoint of this job's own storage is in that
        // storage already: the next checkpoint references its file there instead of
        // uploading it again (the first checkpoint of every attempt listed the whole restored
        // state under new names, all of it counted as new bytes).
        let mut uploaded = HashMap::new();
        if let Some(r) = ctx.restore.as_ref().filter(|r| r.files_in_job_storage) {
            for p in store.segment_paths() {
                if let Some((id, f)) = linked.remove(&p) {
                    if Path::new(&f.path).starts_with(weir_io::SHARED_DIR) {
                        uploaded.insert(id, (f, r.checkpoint_id, r.checkpoint_id));
                    }
                }
            }
        }
        let mut be = KeyedBackend::new(store, range)
            .map_err(|e| err(format!("{}: reading timers: {e}", dir.display())))?;
        be.restore_state_types(restored_types);
        let maint = if ctx.real_io {
            Some(Self::spawn(shard, dir.clone(), ctx.maintenance.enter()).map_err(err)?)
        } else {
            None
        };
        Ok(Self {
            inner: Rc::new(RefCell::new(Inner {
                be,
                shard,
                operator: name.to_string(),
                maint,
                checkpoint: ctx.checkpoint.clone(),
                uploaded,
                restored_timers,
                counters: ctx.metrics.state(name, shard),
            })),
        })
    }

    /// The store's maintenance thread, working for the store in `dir`. It outlives the store
    /// by at most a yield period of the job it is running (see `Inner`'s drop), then removes
    /// `dir`; `live` counts it among the job's threads until everything it held is dropped.
    fn spawn(shard: usize, dir: PathBuf, live: LiveThread) -> Result<Maintenance, String> {
        let (jtx, jrx) = mpsc::channel::<Job>();
        let (dtx, drx) = mpsc::channel::<Output>();
        let cancel = Arc::new(AtomicBool::new(false));
        let stop = cancel.clone();
        std::thread::Builder::new()
            .name(format!("weir-maint-{shard}"))
            .spawn(move || {
                background_priority();
                serve(&jrx, &dtx, &stop);
                // Dropping the remaining jobs releases their segments and checkpoint writers;
                // the directory is this store's scratch space (checkpoints live in checkpoint
                // storage).
                drop(jrx);
                drop(dtx);
                if stop.load(Ordering::Acquire) {
                    let _ = std::fs::remove_dir_all(&dir);
                }
                // Last: `JobHandle::wait` returns once every job's thread got here.
                drop(live);
            })
            .map_err(|e| format!("maintenance thread: {e}"))?;
        Ok(Maintenance {
            jobs: jtx,
            done: drx,
            snapshots_in_flight: 0,
            cancel,
        })
    }

    /// The timers of the restored checkpoint (one encoded list per restored handle).
    pub(crate) fn take_restored_timers(&self) -> Vec<Vec<u8>> {
        std::mem::take(&mut self.inner.borrow_mut().restored_timers)
    }

    pub(crate) fn key_group_range(&self) -> KeyGroupRange {
        self.inner.borrow().be.key_group_range()
    }

    /// True while the store's frozen memtables wait on maintenance beyond its limit
    /// (`Store::write_stalled`): the shard stops feeding records until flushes catch up.
    pub(crate) fn write_stalled(&self) -> bool {
        self.inner.borrow().be.store().write_stalled()
    }

    /// Installs finished background work and hands out the next job. Never waits.
    pub(crate) fn maintain(&self) -> Result<(), JobError> {
        let mut guard = self.inner.borrow_mut();
        let inner = &mut *guard;
        let shard = inner.shard;
        let fail = |message: String| JobError::Operator {
            operator: "state".into(),
            shard,
            message,
        };
        let Some(m) = &mut inner.maint else {
            let store = inner.be.store_mut();
            if store.needs_maintenance() {
                store
                    .run_pending_maintenance()
                    .map_err(|e| fail(e.to_string()))?;
                publish_metrics(&inner.be, &inner.counters);
            }
            return Ok(());
        };
        loop {
            match m.done.try_recv() {
                Ok(Output::Maintenance(done)) => {
                    inner
                        .be
                        .store_mut()
                        .install(done)
                        .map_err(|e| fail(e.to_string()))?;
                    publish_metrics(&inner.be, &inner.counters);
                }
                Ok(Output::Snapshot {
                    checkpoint_id,
                    result,
                    elapsed_ns,
                }) => {
                    m.snapshots_in_flight -= 1;
                    // The local snapshot's segments are now in checkpoint storage (or the
                    // checkpoint failed): the store may drop them when compaction replaces them.
                    inner.be.store_mut().release_snapshot(checkpoint_id);
                    let result = result.map(|(part, uploaded, reused)| {
                        for (seg, f) in uploaded {
                            inner
                                .uploaded
                                .insert(seg, (f, checkpoint_id, checkpoint_id));
                        }
                        for seg in reused {
                            if let Some(e) = inner.uploaded.get_mut(&seg) {
                                e.2 = e.2.max(checkpoint_id);
                            }
                        }
                        part
                    });
                    if let Some(c) = &inner.checkpoint {
                        c.borrow_mut()
                            .report_async_done(checkpoint_id, result, elapsed_ns);
                    }
                }
                Err(mpsc::TryRecvError::Empty) => break,
                Err(mpsc::TryRecvError::Disconnected) => {
                    return Err(fail("the maintenance thread stopped".into()))
                }
            }
        }
        let store = inner.be.store_mut();
        if !store.needs_maintenance() {
            return Ok(());
        }
        // A flush and a compaction may be in flight together: the thread runs the flush at
        // the compaction's next yield, so that a full memtable waits for a flush, not for a
        // compaction of the whole state (seconds with large state, the shard stalled all the
        // while). The store hands out neither while one of its kind is in flight.
        let stopped = |_| fail("the maintenance thread stopped".into());
        if let Some(j) = store.flush_job() {
            let job = maintenance_job(move |y| j.run_yielding(y));
            m.jobs.send(Job::Flush(job)).map_err(stopped)?;
        }
        if let Some(j) = store.compaction_job() {
            let job = maintenance_job(move |y| j.run_yielding(y));
            m.jobs.send(Job::Compaction(job)).map_err(stopped)?;
        }
        Ok(())
    }

    /// Checkpoint `id` reached the operator: seals the store's memtable (the synchronous part)
    /// and hands the rest — writing the sealed epoch as a segment, uploading the segments
    /// checkpoint storage does not hold yet — to the maintenance thread. `timers` is stored
    /// inline. The part is reported to the shard's checkpoint when done.
    pub(crate) fn snapshot(&self, id: u64, timers: Vec<u8>) {
        let t0 = Instant::now();
        let mut guard = self.inner.borrow_mut();
        let inner = &mut *guard;
        let Some(ckpt) = inner.checkpoint.clone() else {
            return;
        };
        let job = inner.be.snapshot(id);
        // The states' kinds and value types, inline beside the state (a later restore checks
        // each state's first use against them).
        let types = inner.be.state_types();
        let types = (!types.is_empty()).then(|| Part {
            operator: inner.operator.clone(),
            kind: PartKind::StateTypes,
            bytes: crate::checkpoint::snapshot::encode(&StateTypesPart { types }),
            files: Vec::new(),
            logical: Vec::new(),
        });
        let sync_ns = t0.elapsed().as_nanos() as u64;
        let store = ckpt.borrow().shared.store.clone();
        let shard = inner.shard;
        let operator = inner.operator.clone();
        // Reuse only files of complete checkpoints: an aborted checkpoint's files are deleted
        // with it, and a complete one keeps its files while a retained checkpoint (the newest
        // always references every live segment) refers to them.
        let incremental = {
            let c = ckpt.borrow();
            let ids = c
                .shared
                .completed_ids
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            inner
                .uploaded
                .retain(|_, (_, by, last)| ids.contains(by) || ids.contains(last));
            c.shared.config.incremental
        };
        // A full (not incremental) checkpoint reuses nothing: it copies every segment of the
        // state again (a link would be the same bytes under another name), so that it shares
        // no file with another checkpoint.
        let known: HashMap<u64, FileRefData> = if incremental {
            inner
                .uploaded
                .iter()
                .map(|(k, (f, _, _))| (*k, f.clone()))
                .collect()
        } else {
            HashMap::new()
        };
        let work = move || {
            let t = Instant::now();
            let result = (|| -> Result<SnapshotUploads, String> {
                let handle = job
                    .run()
                    .map_err(|e| format!("snapshot of `{operator}`: {e}"))?;
                let mut segments = Vec::new();
                let mut files = Vec::new();
                let mut new = Vec::new();
                let mut reused_ids = Vec::new();
                for seg in &handle.segments {
                    // A known file can be gone when checkpoints run concurrently: another one
                    // completed since this one's barrier, and retention dropped what only
                    // older checkpoints held. Then the segment is uploaded again.
                    let reused = match known.get(&seg.segment_id) {
                        Some(f) => store.reuse_shared(id, shard, f)?.then(|| f.clone()),
                        None => None,
                    };
                    let f = match reused {
                        Some(f) => {
                            reused_ids.push(seg.segment_id);
                            f
                        }
                        None => {
                            let f = store.upload_shared(
                                id,
                                shard,
                                &seg.path,
                                seg.size_bytes,
                                seg.crc32,
                                !incremental,
                            )?;
                            new.push((seg.segment_id, f.clone()));
                            f
                        }
                    };
                    segments.push((seg.segment_id, f.clone()));
                    files.push(f);
                }
                let part = KeyedPart {
                    handle: handle.to_bytes(),
                    segments,
                    timers,
                };
                Ok((
                    Part {
                        operator,
                        kind: PartKind::Keyed,
                        bytes: crate::checkpoint::snapshot::encode(&part),
                        files,
                        logical: Vec::new(),
                    },
                    new,
                    reused_ids,
                ))
            })();
            Output::Snapshot {
                checkpoint_id: id,
                result,
                elapsed_ns: t.elapsed().as_nanos() as u64,
            }
        };
        {
            let mut c = ckpt.borrow_mut();
            if let Some(p) = types {
                c.attach(id, p);
            }
            c.report_async_start(id, sync_ns);
        }
        match &mut inner.maint {
            Some(m) => {
                if m.jobs.send(Job::Snapshot(Box::new(work))).is_ok() {
                    m.snapshots_in_flight += 1;
                } else {
                    ckpt.borrow_mut().report_async_done(
                        id,
                        Err("the maintenance thread stopped".into()),
                        0,
                    );
                }
            }
            None => {
                // The test driver has no maintenance thread: run inline.
                if let Output::Snapshot {
                    result, elapsed_ns, ..
                } = work()
                {
                    inner.be.store_mut().release_snapshot(id);
                    ckpt.borrow_mut()
                        .report_async_done(id, result.map(|(p, _, _)| p), elapsed_ns);
                }
            }
        }
    }

    fn with<R>(&self, kg: u16, key: &[u8], ns: &[u8], f: impl FnOnce(&mut KeyedBackend) -> R) -> R {
        let mut i = self.inner.borrow_mut();
        let be = &mut i.be;
        be.set_current_key_bytes(kg, key);
        be.set_namespace(ns);
        f(be)
    }

    /// The id of state `name` (an operator's uid and the state's name).
    pub(crate) fn state_id(&self, name: &str) -> Result<StateId, StateError> {
        // Registering checks that no two names share an id.
        self.inner.borrow_mut().be.try_state_id(name).map(StateId)
    }

    /// That the operator keys its state by `described` (see
    /// `weir_state::KeyedBackend::set_key_type`): refused when the restored checkpoint
    /// recorded another key type.
    pub(crate) fn set_key_type(&self, described: String) -> Result<(), weir_state::StateError> {
        self.inner.borrow_mut().be.set_key_type(described)
    }

    /// Processing time for state TTL (milliseconds since the epoch): entries of states with
    /// a TTL expire relative to it, and compactions started from now on drop the expired.
    pub(crate) fn set_now_ms(&self, now_ms: i64) {
        self.inner
            .borrow_mut()
            .be
            .set_now_ms(u64::try_from(now_ms).unwrap_or(0));
    }

    /// Entries of state `id` expire `ttl_ms` after their last write (Flink's `StateTtlConfig`
    /// with `OnCreateAndWrite` and `NeverReturnExpired`).
    pub(crate) fn set_ttl(&self, id: &StateId, ttl_ms: u64) {
        self.inner.borrow_mut().be.set_ttl(id.0, Some(ttl_ms));
    }

    /// See [`weir_state::KeyedBackend::prefetch_value`].
    #[inline]
    pub(crate) fn prefetch_value(&self, id: &StateId, kg: u16, key: &[u8], ns: &[u8]) -> u64 {
        self.inner.borrow_mut().be.prefetch_value(id.0, kg, key, ns)
    }

    /// See [`weir_state::KeyedBackend::prefetch_record`].
    #[inline]
    pub(crate) fn prefetch_record(&self, hash: u64) {
        self.inner.borrow().be.prefetch_record(hash);
    }

    pub(crate) fn value_get<V: Data>(
        &self,
        id: &StateId,
        kg: u16,
        key: &[u8],
        ns: &[u8],
    ) -> Result<Option<V>, StateError> {
        self.with(kg, key, ns, |be| {
            weir_state::ValueState::<V>::from_id(id.0).value(be)
        })
    }

    pub(crate) fn value_put<V: Data>(
        &self,
        id: &StateId,
        kg: u16,
        key: &[u8],
        ns: &[u8],
        v: &V,
    ) -> Result<(), StateError> {
        self.with(kg, key, ns, |be| {
            weir_state::ValueState::<V>::from_id(id.0).update(be, v)
        })
    }

    /// Read-modify-write of a value state with one lookup: `f` gets the current value and
    /// returns the new one, which is stored and returned.
    pub(crate) fn value_update<V: Data>(
        &self,
        id: &StateId,
        at: (u16, &[u8], &[u8]),
        f: impl FnOnce(Option<V>) -> V,
    ) -> Result<V, StateError> {
        let (kg, key, ns) = at;
        self.with(kg, key, ns, |be| {
            let state = weir_state::ValueState::<V>::from_id(id.0);
            let next = f(state.value(be)?);
            state.update(be, &next)?;
            Ok(next)
        })
    }

    pub(crate) fn delete(
        &self,
        id: &StateId,
        kg: u16,
        key: &[u8],
        ns: &[u8],
    ) -> Result<(), StateError> {
        self.with(kg, key, ns, |be| {
            weir_state::ValueState::<u8>::from_id(id.0).clear(be);
            Ok(())
        })
    }

    pub(crate) fn list_clear(
        &self,
        id: &StateId,
        kg: u16,
        key: &[u8],
        ns: &[u8],
    ) -> Result<(), StateError> {
        self.with(kg, key, ns, |be| {
            weir_state::ListState::<u8>::from_id(id.0).clear(be)
        })
    }

    pub(crate) fn list_append<V: Data>(
        &self,
        id: &StateId,
        kg: u16,
        key: &[u8],
        ns: &[u8],
        v: &V,
    ) -> Result<(), StateError> {
        self.with(kg, key, ns, |be| {
            weir_state::ListState::<V>::from_id(id.0).add(be, v)
        })
    }

    pub(crate) fn list_get<V: Data>(
        &self,
        id: &StateId,
        kg: u16,
        key: &[u8],
        ns: &[u8],
    ) -> Result<Vec<V>, StateError> {
        self.with(kg, key, ns, |be| {
            weir_state::ListState::<V>::from_id(id.0).get(be)
        })
    }

    /// The map state's entry `mk` of the current key (see `KeyedContext::map_get`).
    pub(crate) fn map_get<M: weir_state::KeyCodec + ?Sized + 'static, V: Data>(
        &self,
        id: &StateId,
        at: (u16, &[u8], &[u8]),
        mk: &M,
    ) -> Result<Option<V>, StateError> {
        let (kg, key, ns) = at;
        self.with(kg, key, ns, |be| {
            weir_state::MapState::<M, V>::from_id(id.0).value(be, mk)
        })
    }

    pub(crate) fn map_put<M: weir_state::KeyCodec + ?Sized + 'static, V: Data>(
        &self,
        id: &StateId,
        at: (u16, &[u8], &[u8]),
        mk: &M,
        v: &V,
    ) -> Result<(), StateError> {
        let (kg, key, ns) = at;
        self.with(kg, key, ns, |be| {
            weir_state::MapState::<M, V>::from_id(id.0).put(be, mk, v)
        })
    }

    pub(crate) fn map_remove<M: weir_state::KeyCodec + ?Sized + 'static>(
        &self,
        id: &StateId,
        at: (u16, &[u8], &[u8]),
        mk: &M,
    ) -> Result<(), StateError> {
        let (kg, key, ns) = at;
        self.with(kg, key, ns, |be| {
            weir_state::MapState::<M, u8>::from_id(id.0).remove(be, mk)
        })
    }

    pub(crate) fn map_entries<M: weir_state::KeyCodec + ?Sized + 'static, V: Data>(
        &self,
        id: &StateId,
        at: (u16, &[u8], &[u8]),
    ) -> Result<Vec<(M::Owned, V)>, StateError> {
        let (kg, key, ns) = at;
        self.with(kg, key, ns, |be| {
            weir_state::MapState::<M, V>::from_id(id.0).entries(be)
        })
    }

    pub(crate) fn map_clear(
        &self,
        id: &StateId,
        kg: u16,
        key: &[u8],
        ns: &[u8],
    ) -> Result<(), StateError> {
        self.with(kg, key, ns, |be| {
            weir_state::MapState::<[u8], u8>::from_id(id.0).clear(be)
        })
    }
}

/// A maintenance thread's loop: runs `jobs` in order, a flush or snapshot that arrives during
/// a compaction (a snapshot also during a flush) at that job's next yield, and sends each
/// job's output to `done`, until the channel closes or `stop` is set.
fn serve(jobs: &mpsc::Receiver<Job>, done: &mpsc::Sender<Output>, stop: &AtomicBool) {
    // Jobs that arrived while another ran and must wait for it, in order.
    let mut deferred = VecDeque::new();
    loop {
        let job = match deferred.pop_front() {
            Some(j) => j,
            None => match jobs.recv() {
                Ok(j) => j,
                Err(_) => return,
            },
        };
        if stop.load(Ordering::Acquire) {
            return;
        }
        let out = match job {
            Job::Snapshot(f) => f(),
            Job::Flush(f) => f(&mut || take_arrivals(jobs, done, stop, &mut deferred, false)),
            Job::Compaction(f) => f(&mut || take_arrivals(jobs, done, stop, &mut deferred, true)),
        };
        if done.send(out).is_err() {
            return;
        }
    }
}

/// Serves the jobs that reached a maintenance thread while it runs one (called at that job's
/// yields): a snapshot's asynchronous part runs at once, so that a checkpoint waits
/// milliseconds, not the seconds a compaction of a large state takes (the duration bench's
/// p99 was 1.5-9.4 s, its checkpoints queued behind compactions); so does a flush if
/// `flushes_too` (the job running is a compaction); anything else waits in `deferred`.
/// Breaks once `stop` is set: the store is gone, and the job running stops rather than keep a
/// core for seconds that the restore of the next attempt wants (a compaction of a large
/// state goes on for 3-4 s).
fn take_arrivals(
    jobs: &mpsc::Receiver<Job>,
    done: &mpsc::Sender<Output>,
    stop: &AtomicBool,
    deferred: &mut VecDeque<Job>,
    flushes_too: bool,
) -> ControlFlow<()> {
    while let Ok(j) = jobs.try_recv() {
        if stop.load(Ordering::Acquire) {
            // Dropped: the store is gone.
            continue;
        }
        match j {
            Job::Snapshot(f) => {
                let _ = done.send(f());
            }
            Job::Flush(f) if flushes_too => {
                let out = f(&mut || take_arrivals(jobs, done, stop, deferred, false));
                let _ = done.send(out);
            }
            j => deferred.push_back(j),
        }
    }
    if stop.load(Ordering::Acquire) {
        ControlFlow::Break(())
    } else {
        ControlFlow::Continue(())
    }
}

/// Lowers the calling thread's scheduling priority: background state work (flushes,
/// compactions, snapshot uploads, channel state) yields the cores to the shards when both
/// want them, so it adds less to processing latency (DESIGN invariant 5: bounded shares).
pub(crate) fn background_priority() {
    // SAFETY: gettid has no preconditions; setpriority on our own thread id only changes this
    // thread's nice value, and raising it needs no privilege. A failure leaves it unchanged.
    unsafe {
        let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
        let _ = libc::setpriority(libc::PRIO_PROCESS, tid, 10);
    }
}

/// Removes the directory it holds when dropped, unless taken out first.
struct RemoveOnDrop(Option<PathBuf>);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        if let Some(p) = self.0.take() {
            let _ = std::fs::remove_dir_all(p);
        }
    }
}

/// The file a store error names, if it names one.
fn named_file(e: &StateError) -> Option<&Path> {
    match e {
        StateError::HandleMismatch { file, .. } => Some(file),
        e => e.as_format().map(|f| f.file()),
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::checkpoint::restore::RestoreState;
    use crate::checkpoint::snapshot::{
        encode, shard_section, JobSnapshot, ShardSnapshot, JOB_SECTION, SECTIONS_VERSION,
    };
    use crate::checkpoint::store::StorageReader;
    use crate::config::JobConfig;
    use crate::graph::{BuildCtx, FailCell};
    use weir_io::{CheckpointStorage, CommitInfo, FaultyFs, StdFs};

    /// A checkpoint file gone fails the restore for good; another I/O fault lets a restart
    /// try again.
    #[test]
    fn a_restore_missing_a_file_is_not_retried() {
        let os = |kind: std::io::ErrorKind| {
            weir_io::CheckpointError::Io(weir_io::IoError::Os {
                op: "link",
                path: "shared/1.wseg".into(),
                source: std::io::Error::from(kind),
            })
        };
        assert!(!may_pass(&os(std::io::ErrorKind::NotFound)));
        assert!(may_pass(&os(std::io::ErrorKind::Other)));
        assert!(may_pass(&weir_io::CheckpointError::Io(
            weir_io::IoError::Injected {
                seed: 1,
                step: 2,
                what: "link",
                path: "shared/1.wseg".into(),
            }
        )));
    }

    const MP: u16 = 8;
    const OP: &str = "op";

    fn key(kg: u16, u: u32) -> Vec<u8> {
        let mut k = kg.to_be_bytes().to_vec();
        k.extend_from_slice(&7u16.to_be_bytes());
        k.extend_from_slice(&u.to_be_bytes());
        k
    }

    /// Checkpoint 1 of a job with one shard whose keyed operator `op` holds two segments:
    /// values of every key group, then a newer one deleting some of them. Returns the
    /// storage and the uploaded files' paths.
    fn checkpoint(root: &Path) -> (CheckpointStorage, Vec<std::path::PathBuf>) {
        checkpoint_with(root, |_| {})
    }

    /// [`checkpoint`] whose keyed part's state handle describes each segment through `edit`.
    fn checkpoint_with(
        root: &Path,
        edit: fn(&mut weir_state::SegmentRef),
    ) -> (CheckpointStorage, Vec<std::path::PathBuf>) {
        let fs: Arc<dyn Fs> = Arc::new(StdFs);
        let mut s = Store::open(
            fs.clone(),
            &root.join("old"),
            StoreConfig {
                max_parallelism: MP,
                ..StoreConfig::default()
            },
        )
        .unwrap();
        for kg in 0..MP {
            for u in 0..500 {
                s.put(&key(kg, u), &[kg as u8; 40]);
            }
        }
        s.freeze();
        s.run_pending_maintenance().unwrap();
        for kg in 0..MP {
            for u in (0..500).step_by(2) {
                s.delete(&key(kg, u));
            }
        }
        s.freeze();
        s.run_pending_maintenance().unwrap();
        let mut h = s.snapshot(1).run().unwrap();
        assert_eq!(h.segments.len(), 2);
        let st = CheckpointStorage::open(fs, &root.join("ckpt"), "job").unwrap();
        let p = st.begin(1).unwrap();
        let mut w = p.writer();
        let mut segments = Vec::new();
        let mut files = Vec::new();
        for seg in &h.segments {
            let f = w.upload_shared(&seg.path, "seg").unwrap();
            let f = FileRefData {
                path: f.path.to_string_lossy().into_owned(),
                size_bytes: f.size_bytes,
                crc32: f.crc32,
            };
            segments.push((seg.segment_id, f.clone()));
            files.push(f);
        }
        w.finish().unwrap();
        h.segments.iter_mut().for_each(edit);
        let part = KeyedPart {
            handle: h.to_bytes(),
            segments,
            timers: Vec::new(),
        };
        let shard = ShardSnapshot {
            shard: 0,
            parts: vec![Part {
                operator: OP.into(),
                kind: PartKind::Keyed,
                bytes: encode(&part),
                files: files.clone(),
                logical: Vec::new(),
            }],
        };
        let job = JobSnapshot {
            shards: 1,
            max_parallelism: MP,
            format_version: SECTIONS_VERSION,
        };
        let sections = vec![
            (JOB_SECTION.to_string(), encode(&job)),
            (shard_section(0), encode(&shard)),
        ];
        st.commit(
            p,
            CommitInfo {
                trigger_timestamp_ms: 1,
                completion_timestamp_ms: 2,
                sections,
            },
        )
        .unwrap();
        let paths = files.iter().map(|f| st.job_dir().join(&f.path)).collect();
        (st, paths)
    }

    fn open(st: &CheckpointStorage, state_dir: &Path) -> Result<ShardState, StartError> {
        let m = st.read_metadata(1).unwrap();
        let config = JobConfig {
            shards: 1,
            max_parallelism: MP,
            ..JobConfig::default()
        };
        let restore = RestoreState::decode(&m, Arc::new(StorageReader(st.clone())), 1, MP).unwrap();
        let ctx = BuildCtx {
            shard: 0,
            shards: 1,
            state_dir: state_dir.to_path_buf(),
            real_io: false,
            states: Vec::new(),
            checkpoint: None,
            restore: Some(Arc::new(restore)),
            config: Arc::new(config),
            heads: Vec::new(),
            gate: Default::default(),
            exchanges: crate::exchange::wire(0, 1, 1 << 16).remove(0),
            metrics: crate::metrics::Registry::new(),
            fail: FailCell::default(),
            epoch: Instant::now(),
            maintenance: Default::default(),
            split_tags: Vec::new(),
            stop: Default::default(),
        };
        ShardState::open_for(&ctx, OP)
    }

    fn get(s: &ShardState, k: &[u8]) -> Option<Vec<u8>> {
        let i = s.inner.borrow();
        i.be.store().get(k).unwrap().map(|f| f.value.to_vec())
    }

    /// The restored store shadows the older segment's values with the newer one's tombstones,
    /// and its later flushes and compactions never change a byte of the checkpoint's files.
    #[test]
    fn restore_keeps_tombstones_and_never_writes_checkpoint_files() {
        let tmp = tempfile::tempdir().unwrap();
        let (st, paths) = checkpoint(tmp.path());
        let before: Vec<Vec<u8>> = paths.iter().map(|p| std::fs::read(p).unwrap()).collect();
        let s = open(&st, &tmp.path().join("state")).unwrap();
        let check = |s: &ShardState| {
            for kg in 0..MP {
                for u in 0..500 {
                    let want = (u % 2 == 1).then(|| vec![kg as u8; 40]);
                    assert_eq!(get(s, &key(kg, u)), want, "kg {kg} user {u}");
                }
            }
        };
        check(&s);
        {
            let mut i = s.inner.borrow_mut();
            let store = i.be.store_mut();
            for round in 0..3u8 {
                for u in 1000..3000 {
                    store.put(&key(u as u16 % MP, u), &[round; 64]);
                }
                store.freeze();
                store.run_pending_maintenance().unwrap();
            }
            store.flush_and_compact_all().unwrap();
        }
        check(&s);
        drop(s);
        let after: Vec<Vec<u8>> = paths.iter().map(|p| std::fs::read(p).unwrap()).collect();
        assert!(before == after, "a checkpoint file changed");
        st.verify(1).unwrap();
    }

    /// With the default job configuration a flushed memtable stays readable in its store's
    /// read cache, so the keys a job keeps updating are read from memory after a freeze, not
    /// from the segment. (A cache smaller than a memtable at its freeze holds nothing: the
    /// default of 64 MiB against 80 MiB memtables did that.)
    #[test]
    fn the_default_read_cache_holds_a_flushed_memtable() {
        let tmp = tempfile::tempdir().unwrap();
        let config = store_config(&JobConfig::default());
        let mut store = Store::open(Arc::new(StdFs), tmp.path(), config).unwrap();
        let mut u = 0u32;
        while store.frozen_memtables() == 0 {
            store.put(&key((u % u32::from(MP)) as u16, u), &[1; 16]);
            u += 1;
        }
        store.run_pending_maintenance().unwrap();
        let m = store.metrics();
        assert_eq!((m.frozen_memtables, m.retained_memtables), (0, 1), "{m:?}");
        assert_eq!(m.segments, 1);
        for v in [0, u / 2, u - 1] {
            let k = key((v % u32::from(MP)) as u16, v);
            assert_eq!(store.get(&k).unwrap().unwrap().value, [1; 16]);
        }
        assert_eq!(store.metrics().retained_hits, m.retained_hits + 3);
    }

    /// A run directory left by a dead process is removed when the operator's store opens
    /// again; a locked one (a live store of another process) and this process's are kept.
    #[test]
    fn stale_run_directories_of_dead_processes_are_removed() {
        let tmp = tempfile::tempdir().unwrap();
        let op = tmp.path().join("op");
        let dead = op.join("run-999999999-0");
        let live = op.join("run-999999998-0");
        let ours = op.join(format!("run-{}-77", std::process::id()));
        for d in [&dead, &live, &ours] {
            std::fs::create_dir_all(d).unwrap();
            std::fs::write(d.join("seg"), b"x").unwrap();
        }
        std::fs::write(op.join("old-layout.wseg"), b"x").unwrap();
        let lock = weir_io::DirLock::acquire(&live).unwrap();
        remove_stale_runs(&op);
        assert!(!dead.exists());
        assert!(!op.join("old-layout.wseg").exists());
        assert!(live.join("seg").exists() && ours.join("seg").exists());
        drop(lock);
    }

    /// The error of a failed restore of `op` from [`checkpoint`] into `state_dir`, after
    /// checking that it left none of its links or copies behind.
    fn restore_error(st: &CheckpointStorage, state_dir: &Path) -> String {
        let e = match open(st, state_dir) {
            Err(StartError::State { reason, .. }) => reason,
            Err(e) => panic!("unexpected error {e}"),
            Ok(_) => panic!("a corrupt segment was restored"),
        };
        let runs: Vec<_> = std::fs::read_dir(state_dir.join("shard-0").join(OP))
            .unwrap()
            .map(|r| r.unwrap().path())
            .collect();
        assert_eq!(runs.len(), 1, "{runs:?}");
        assert!(!runs[0].join("restore").exists(), "links left behind: {e}");
        e
    }

    /// A checkpoint segment corrupted after the checkpoint verified (restore links it without
    /// reading it) is never used: the store's open checks every block, and the restore fails
    /// naming the checkpoint, the checkpoint file and the damaged block's offset.
    #[test]
    fn corrupt_checkpoint_segment_fails_restore_naming_checkpoint_file_and_offset() {
        let tmp = tempfile::tempdir().unwrap();
        let (st, paths) = checkpoint(tmp.path());
        let len = std::fs::metadata(&paths[1]).unwrap().len();
        // A payload byte in the middle of the second (newer) segment's file.
        FaultyFs::flip_bit(&paths[1], len / 2, 3).unwrap();
        let e = restore_error(&st, &tmp.path().join("state"));
        assert!(e.contains("checkpoint 1"), "{e}");
        assert!(e.contains(&paths[1].display().to_string()), "{e}");
        let offset: u64 = e
            .split("at offset ")
            .nth(1)
            .and_then(|t| t.split(':').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no offset in {e}"));
        assert!(offset > 0 && offset <= len / 2, "{e}");
    }

    /// A segment whose file reference and state handle disagree (size or CRC) is refused
    /// before it is linked: the store checks the file against the handle only. (A reference
    /// that disagrees with the file the metadata lists is refused earlier, by
    /// `decode_metadata`.)
    #[test]
    fn a_segment_whose_file_reference_and_handle_disagree_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let (st, paths) = checkpoint_with(tmp.path(), |seg| seg.crc32 ^= 1);
        let e = restore_error(&st, &tmp.path().join("state"));
        assert!(
            e.contains("checkpoint 1")
                && e.contains(&paths[0].display().to_string())
                && e.contains("its state handle as"),
            "{e}"
        );
    }

    /// A fake job's output, told apart by `id`.
    fn out(id: u64) -> Output {
        Output::Snapshot {
            checkpoint_id: id,
            result: Err(String::new()),
            elapsed_ns: 0,
        }
    }

    fn id_of(o: Output) -> u64 {
        match o {
            Output::Snapshot { checkpoint_id, .. } => checkpoint_id,
            Output::Maintenance(_) => panic!("no store job was sent"),
        }
    }

    /// On a maintenance thread, a flush that arrives during a compaction runs at the
    /// compaction's next yield (a full memtable waits for a flush, not for a compaction of
    /// the whole state), while a compaction that arrives during a flush waits for it.
    #[test]
    fn a_flush_overtakes_a_running_compaction_and_a_compaction_waits_for_a_flush() {
        let (jtx, jrx) = mpsc::channel::<Job>();
        let (dtx, drx) = mpsc::channel::<Output>();
        let thread = std::thread::spawn(move || serve(&jrx, &dtx, &AtomicBool::new(false)));
        let flushed = Arc::new(AtomicBool::new(false));
        let (started_tx, started) = mpsc::channel::<()>();
        // A compaction that yields until the flush sent after it ran (10 s at most): its
        // output says whether it saw the flush.
        let seen = flushed.clone();
        let started_c = started_tx.clone();
        jtx.send(Job::Compaction(Box::new(
            move |y: &mut dyn FnMut() -> ControlFlow<()>| {
                started_c.send(()).unwrap();
                let t0 = Instant::now();
                while !seen.load(Ordering::Acquire) && t0.elapsed().as_secs() < 10 {
                    assert!(y().is_continue());
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
                out(if seen.load(Ordering::Acquire) { 1 } else { 0 })
            },
        )))
        .unwrap();
        started.recv().unwrap();
        let f = flushed.clone();
        jtx.send(Job::Flush(Box::new(
            move |_: &mut dyn FnMut() -> ControlFlow<()>| {
                f.store(true, Ordering::Release);
                out(2)
            },
        )))
        .unwrap();
        assert_eq!(id_of(drx.recv().unwrap()), 2, "the flush finished first");
        assert_eq!(
            id_of(drx.recv().unwrap()),
            1,
            "the compaction saw the flush"
        );

        // A flush that yields while a compaction arrives: the compaction runs after it.
        let (sent_tx, sent) = mpsc::channel::<()>();
        let running = Arc::new(AtomicBool::new(false));
        let r = running.clone();
        jtx.send(Job::Flush(Box::new(
            move |y: &mut dyn FnMut() -> ControlFlow<()>| {
                r.store(true, Ordering::Release);
                started_tx.send(()).unwrap();
                sent.recv().unwrap();
                for _ in 0..3 {
                    assert!(y().is_continue());
                }
                r.store(false, Ordering::Release);
                out(3)
            },
        )))
        .unwrap();
        started.recv().unwrap();
        let r = running.clone();
        jtx.send(Job::Compaction(Box::new(
            move |_: &mut dyn FnMut() -> ControlFlow<()>| {
                out(if r.load(Ordering::Acquire) { 0 } else { 4 })
            },
        )))
        .unwrap();
        sent_tx.send(()).unwrap();
        assert_eq!(id_of(drx.recv().unwrap()), 3);
        assert_eq!(
            id_of(drx.recv().unwrap()),
            4,
            "the compaction ran after the flush, not inside it"
        );
        drop(jtx);
        thread.join().unwrap();
    }

    /// Once the store is gone (`stop`), a running job's yield hook breaks, so that a failed
    /// attempt's compaction stops instead of taking a core from the next attempt's restore;
    /// jobs still queued are dropped.
    #[test]
    fn a_running_job_is_told_to_stop_once_its_store_is_gone() {
        let (jtx, jrx) = mpsc::channel::<Job>();
        let (dtx, drx) = mpsc::channel::<Output>();
        let stop = Arc::new(AtomicBool::new(false));
        let stop2 = stop.clone();
        let thread = std::thread::spawn(move || serve(&jrx, &dtx, &stop2));
        let (started_tx, started) = mpsc::channel::<()>();
        jtx.send(Job::Compaction(Box::new(
            move |y: &mut dyn FnMut() -> ControlFlow<()>| {
                started_tx.send(()).unwrap();
                let t0 = Instant::now();
                while t0.elapsed().as_secs() < 10 {
                    if y().is_break() {
                        return out(1);
                    }
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
                out(0)
            },
        )))
        .unwrap();
        started.recv().unwrap();
        stop.store(true, Ordering::Release);
        jtx.send(Job::Flush(Box::new(
            |_: &mut dyn FnMut() -> ControlFlow<()>| out(2),
        )))
        .unwrap();
        assert_eq!(
            id_of(drx.recv().unwrap()),
            1,
            "the compaction was told to stop"
        );
        drop(jtx);
        thread.join().unwrap();
        assert!(drx.try_recv().is_err(), "the queued flush ran");
    }
}
