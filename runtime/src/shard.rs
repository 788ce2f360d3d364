//! Shards, attempts and restarts.
//!
//! A job runs as *attempts*. An attempt wires the rings, starts one glommio executor thread per
//! shard — each builds every chain's operators and then drives their heads in a loop — and,
//! with checkpointing, a coordinator thread. When an attempt fails and the restart strategy
//! allows it, the next attempt restores every shard from the newest complete checkpoint.
//!
//! A shard's loop steps each head in turn. A head that moved data is stepped again right away
//! (yielding to glommio when its time slice is used up); when no head moved anything the shard
//! backs off, first by spinning briefly, then by sleeping with a growing interval, so that more
//! shards than cores (tests run 4 shards on 2 cores) still share the machine fairly.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use glommio::{LocalExecutorBuilder, Placement};

use crate::backend::MaintenanceThreads;
use crate::checkpoint::coordinator::{Coordinator, Requests, SavepointRequest};
use crate::checkpoint::restore::RestoreState;
use crate::checkpoint::shard::{ShardCheckpoint, Shared};
use crate::checkpoint::snapshot::PartKind;
use crate::checkpoint::store::{IoCheckpointStore, SavepointReader, StorageReader};
use crate::checkpoint::{CheckpointMetrics, RestartStrategy};
use crate::config::{JobConfig, Pinning, RestoreFrom};
use crate::error::{JobError, SavepointError, StartError};
use crate::graph::{BuildCtx, FailCell, Gate, Graph, HeadStatus, Root};
use crate::metrics::{JobMetrics, Registry};
use crate::platform::nap;

/// Rounds without progress before a shard starts sleeping.
const IDLE_SPIN_ROUNDS: u32 = 64;

/// What the job handle and the supervisor share.
struct Control {
    cancel: AtomicBool,
    finished: AtomicBool,
    metrics: Mutex<Arc<Registry>>,
    checkpoints: Arc<Mutex<CheckpointMetrics>>,
    requests: Arc<Requests>,
    restarts: AtomicU64,
    checkpointing: bool,
    /// The status and its history; the shards of an attempt set `Running`.
    status: Arc<StatusCell>,
}

/// A change of a job's status (Flink keeps the same per status, as its job details'
/// `timestamps`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StatusChange {
    /// The status entered.
    pub status: JobStatus,
    /// When, in milliseconds since the Unix epoch.
    pub at_ms: u64,
    /// The attempt it belongs to: 0 for the first, one more after each restart.
    pub attempt: u64,
}

/// A job's current status (read on every [`JobHandle::status`] without a lock) and every
/// change of it, in order. A test or a service that wants to know that a restart happened,
/// or how long a restore kept the job `Initializing`, reads the history: sampling
/// [`JobHandle::status`] misses states shorter than its polling interval.
struct StatusCell {
    now: AtomicU8,
    history: Mutex<Vec<StatusChange>>,
}

impl StatusCell {
    fn new() -> StatusCell {
        StatusCell {
            now: AtomicU8::new(JobStatus::Initializing as u8),
            history: Mutex::new(vec![StatusChange {
                status: JobStatus::Initializing,
                at_ms: crate::checkpoint::coordinator::now_ms(),
                attempt: 0,
            }]),
        }
    }

    fn get(&self) -> JobStatus {
        JobStatus::from_u8(self.now.load(Ordering::Acquire))
    }

    /// Enter `status` in `attempt`. The history is appended before the status is published,
    /// under its lock, so that a reader who saw a status finds it in the history, and the
    /// history's order is the order of the changes.
    fn set(&self, status: JobStatus, attempt: u64) {
        let mut h = lock(&self.history);
        h.push(StatusChange {
            status,
            at_ms: crate::checkpoint::coordinator::now_ms(),
            attempt,
        });
        self.now.store(status as u8, Ordering::Release);
    }
}

/// Where a job is in its life, in Flink's terms.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum JobStatus {
    /// An attempt's shards are being built: operators made, state restored, state memory
    /// faulted in. No source reads yet.
    Initializing = 0,
    /// Every shard of the current attempt is built and its loop runs.
    Running = 1,
    /// An attempt failed and the restart strategy allows another; its delay runs. The next
    /// attempt is `Initializing`, then `Running`.
    Restarting = 2,
    /// Every source ended and every record went through ([`JobHandle::wait`] returns the
    /// summary).
    Finished = 3,
    /// The job failed and will not restart ([`JobHandle::wait`] returns why).
    Failed = 4,
    /// [`JobHandle::cancel`] stopped it.
    Cancelled = 5,
}

impl JobStatus {
    fn from_u8(v: u8) -> Self {
        match v {
            0 => Self::Initializing,
            1 => Self::Running,
            2 => Self::Restarting,
            3 => Self::Finished,
            4 => Self::Failed,
            _ => Self::Cancelled,
        }
    }

    /// True for `Finished`, `Failed` and `Cancelled`.
    pub fn is_terminal(self) -> bool {
        matches!(self, Self::Finished | Self::Failed | Self::Cancelled)
    }
}

/// A running job.
pub struct JobHandle {
    supervisor: Option<std::thread::JoinHandle<Result<(), JobError>>>,
    ctl: Arc<Control>,
    shards: usize,
    /// The core each shard is pinned to, if it is.
    cores: Vec<Option<usize>>,
    maintenance: Arc<MaintenanceThreads>,
    _state_dir: Option<tempfile::TempDir>,
}

/// What a finished job reports.
#[derive(Clone, Debug)]
pub struct JobSummary {
    pub shards: usize,
    pub metrics: JobMetrics,
    pub checkpoints: CheckpointMetrics,
    /// How many times the job restarted after a failure.
    pub restarts: u64,
    /// Every status the job entered, as [`JobHandle::status_history`].
    pub status_history: Vec<StatusChange>,
}

impl JobHandle {
    /// Waits until the job finished (after any restarts) and let go of its files: every
    /// state store's maintenance thread has exited, so the checkpoint directory's lock is free
    /// for the next job and the state directory holds nothing of this one.
    pub fn wait(mut self) -> Result<JobSummary, JobError> {
        let r = match self.supervisor.take() {
            Some(t) => t.join().unwrap_or_else(|p| {
                Err(JobError::Panic {
                    shard: usize::MAX,
                    message: panic_message(&*p),
                })
            }),
            None => Ok(()),
        };
        // Cancelled at the end of their attempts, they exit at their jobs' next yield, or
        // after the snapshot job they are finishing.
        self.maintenance.wait_all();
        r.map(|()| self.summary())
    }

    fn summary(&self) -> JobSummary {
        JobSummary {
            shards: self.shards,
            metrics: self.metrics(),
            checkpoints: self.checkpoint_metrics(),
            restarts: self.ctl.restarts.load(Ordering::Acquire),
            status_history: self.status_history(),
        }
    }

    /// Asks every shard to stop; [`JobHandle::wait`] then returns [`JobError::Cancelled`].
    pub fn cancel(&self) {
        self.ctl.cancel.store(true, Ordering::Release);
        if let Some(s) = &self.supervisor {
            s.thread().unpark();
        }
    }

    /// True once the job ended.
    pub fn is_finished(&self) -> bool {
        self.ctl.finished.load(Ordering::Acquire)
    }

    /// The job's status now. `Running` means every shard is built and reading: what a caller
    /// that measures steady-state behaviour waits for.
    pub fn status(&self) -> JobStatus {
        self.ctl.status.get()
    }

    /// Every status the job entered so far, oldest first, with its time and attempt: the
    /// first is `Initializing` at the start, a restart adds `Restarting`, then the next
    /// attempt's `Initializing` and `Running`, and a job that ended ends with its terminal
    /// status.
    pub fn status_history(&self) -> Vec<StatusChange> {
        lock(&self.ctl.status.history).clone()
    }

    /// A snapshot of the current attempt's metrics.
    pub fn metrics(&self) -> JobMetrics {
        lock(&self.ctl.metrics).snapshot()
    }

    /// The job's checkpoint metrics.
    pub fn checkpoint_metrics(&self) -> CheckpointMetrics {
        lock(&self.ctl.checkpoints).clone()
    }

    /// Triggers a checkpoint now (it starts as soon as no other is in progress; requests made
    /// before the job's coordinator runs, or during a restart, are served once it does, and
    /// requests made before a trigger is served share its checkpoint). A job that has ended
    /// takes none: an error, as [`Self::trigger_savepoint`] gives (it returned `Ok` and
    /// nothing came of it).
    pub fn trigger_checkpoint(&self) -> Result<(), StartError> {
        if !self.ctl.checkpointing {
            return Err(StartError::Config {
                key: "checkpoint".into(),
                reason: "the job has no checkpoint directory".into(),
            });
        }
        if self.is_finished() {
            return Err(StartError::Checkpoint {
                reason: format!(
                    "the job has ended ({:?}): it takes no checkpoint",
                    self.status()
                ),
            });
        }
        self.ctl.requests.manual.fetch_add(1, Ordering::AcqRel);
        Ok(())
    }

    /// Takes a savepoint (Flink's triggered savepoint): triggers a checkpoint now, waits for
    /// it to complete, and copies everything it uses into a self-contained directory
    /// `dir/savepoint-<checkpoint>-<nonce>`, which it returns. A savepoint belongs to the user:
    /// retention never deletes it, and `--restore PATH` (or [`RestoreFrom::Path`]) starts a
    /// job from it, on any number of shards. Blocks the calling thread, never a shard; the
    /// checkpoint is pinned against retention while it is copied.
    pub fn trigger_savepoint(&self, dir: &Path) -> Result<PathBuf, SavepointError> {
        self.savepoint(dir, false)
    }

    /// Stops the job with a savepoint (Flink's stop-with-savepoint), the way to upgrade or
    /// move a job without duplicating output: as [`Self::trigger_savepoint`], but no
    /// checkpoint is triggered after the savepoint's, so sinks commit exactly up to its
    /// barrier; once it completed and every shard's sinks committed it, the shards end and
    /// [`Self::wait`] returns `Ok` (status `Finished`). Sources read nothing past the
    /// barrier while the stop stands (Flink's synchronous savepoint), so no sink gets a
    /// record that a job restored from the savepoint reads again. If the savepoint
    /// fails (its checkpoint, or copying it out), the job keeps running, checkpointing again,
    /// and this returns the error: the shards end only once the savepoint is out.
    pub fn stop_with_savepoint(&self, dir: &Path) -> Result<PathBuf, SavepointError> {
        self.savepoint(dir, true)
    }

    fn savepoint(&self, dir: &Path, stop: bool) -> Result<PathBuf, SavepointError> {
        if !self.ctl.checkpointing {
            return Err(SavepointError::NoCheckpointing);
        }
        static TOKENS: AtomicU64 = AtomicU64::new(0);
        let token = TOKENS.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::channel();
        lock(&self.ctl.requests.savepoints).push(SavepointRequest {
            waiter: tx,
            token,
            stop,
        });
        // `gate`: a stop's; dropped before `stop` (any error below), the job goes on.
        let (pin, gate) = loop {
            match rx.recv_timeout(Duration::from_millis(20)) {
                Ok(Ok(reply)) => break reply,
                Ok(Err(reason)) => return Err(SavepointError::CheckpointFailed { reason }),
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    // A request no coordinator took before the job ended is never served.
                    if self.is_finished() {
                        return Err(SavepointError::JobEnded);
                    }
                    // Nor, as in Flink, one made or left waiting while the job restarts: it
                    // would wait out the whole restart delay. Withdrawn only if no coordinator
                    // took it yet (one that did answers or drops it); a stop left queued
                    // would stop the job after its caller was told it failed.
                    if self.status() == JobStatus::Restarting {
                        let mut queued = lock(&self.ctl.requests.savepoints);
                        if let Some(i) = queued.iter().position(|r| r.token == token) {
                            queued.remove(i);
                            return Err(SavepointError::Restarting);
                        }
                    }
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    return Err(if self.is_finished() {
                        SavepointError::JobEnded
                    } else {
                        SavepointError::CheckpointFailed {
                            reason: "the job failed over before it completed".into(),
                        }
                    })
                }
            }
        };
        let id = pin.checkpoint_id();
        let name = weir_io::savepoint_dir_name(id);
        let export = |e: String| SavepointError::Export {
            checkpoint_id: id,
            dir: dir.to_owned(),
            reason: e,
        };
        std::fs::create_dir_all(dir).map_err(|e| export(e.to_string()))?;
        let path = pin
            .export_savepoint(dir, &name)
            .map_err(|e| export(e.to_string()))?;
        if let Some(g) = gate {
            g.stop();
        }
        Ok(path)
    }

    /// How many times the job restarted after a failure so far.
    pub fn restarts(&self) -> u64 {
        self.ctl.restarts.load(Ordering::Acquire)
    }

    pub fn shards(&self) -> usize {
        self.shards
    }

    /// The core each shard is pinned to (`None`: unpinned), by shard: see [`Pinning`].
    pub fn shard_cores(&self) -> Vec<Option<usize>> {
        self.cores.clone()
    }
}

impl Drop for JobHandle {
    fn drop(&mut self) {
        if let Some(t) = self.supervisor.take() {
            self.cancel();
            let _ = t.join();
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

pub(crate) fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "panic with a non-text payload".to_string()
    }
}

/// A panic's message in a chain's step, naming the operator that heads the chain (which of
/// its operators panicked, a step does not know; Flink names the task, its chain, likewise).
pub(crate) fn in_chain(payload: &(dyn std::any::Any + Send), head: &str) -> String {
    format!("{} (in the chain from `{head}`)", panic_message(payload))
}

/// Signals the attempt once, when glommio has built the shard's executor and calls its closure,
/// or when the closure is dropped uncalled (no executor): until every shard's has signalled,
/// the attempt holds the process's build lock ([`crate::platform::executor_builds`]).
struct ExecutorBuilt(Option<mpsc::Sender<()>>);

impl ExecutorBuilt {
    fn signal(&mut self) {
        if let Some(tx) = self.0.take() {
            // The attempt stops listening only once every shard signalled.
            let _ = tx.send(());
        }
    }
}

impl Drop for ExecutorBuilt {
    fn drop(&mut self) {
        self.signal();
    }
}

/// Held by a shard's thread for its whole life: however the thread ends, returning or
/// unwinding, the count of running shards drops and the supervisor wakes; a panic, or an end
/// before the shard's future ran to its end, also sets the cancel flag, so that the other
/// shards stop instead of waiting forever on its rings or for it to be built. (A panic while
/// the shard built its operators, in a source's factory say, used to unwind past the count,
/// and the job never ended; an executor that glommio failed to build, out of descriptors
/// say, dropped the shard's closure without running it, and the other shards waited for it.)
struct ShardExit {
    cancel: Arc<AtomicBool>,
    running: Arc<AtomicUsize>,
    supervisor: std::thread::Thread,
    /// The shard's future returned (it sets the cancel flag itself on an error).
    ran: bool,
}

impl Drop for ShardExit {
    fn drop(&mut self) {
        if std::thread::panicking() || !self.ran {
            self.cancel.store(true, Ordering::Release);
        }
        self.running.fetch_sub(1, Ordering::AcqRel);
        self.supervisor.unpark();
    }
}

/// The cores that pinned shards of this process's running jobs hold.
static PINNED_CORES: Mutex<std::collections::BTreeSet<usize>> =
    Mutex::new(std::collections::BTreeSet::new());

/// The cores one job's shards are pinned to, held in [`PINNED_CORES`] until it is dropped,
/// when the job ends: [`Pinning::Auto`] pins a job only onto cores no other running job of the
/// process holds (two jobs pinned shard by shard onto the same cores ran at half speed each
/// while the other cores idled). Empty: every shard unpinned.
struct CoreClaim(Vec<usize>);

impl CoreClaim {
    /// The first `shards` cores no running job holds, or none if fewer are free.
    fn take(shards: usize) -> CoreClaim {
        let cores = core_affinity::get_core_ids().unwrap_or_default();
        let mut held = lock(&PINNED_CORES);
        let free: Vec<usize> = cores
            .iter()
            .map(|c| c.id)
            .filter(|id| !held.contains(id))
            .take(shards)
            .collect();
        if free.len() < shards {
            return CoreClaim(Vec::new());
        }
        held.extend(&free);
        CoreClaim(free)
    }
}

impl Drop for CoreClaim {
    fn drop(&mut self) {
        let mut held = lock(&PINNED_CORES);
        for c in &self.0 {
            held.remove(c);
        }
    }
}

/// Everything an attempt needs, fixed for the job's life.
struct Plan {
    config: Arc<JobConfig>,
    roots: Arc<Vec<Root>>,
    exchanges: usize,
    state_dir: PathBuf,
    sentinel: PathBuf,
    placements: Vec<Placement>,
    store: Option<Arc<IoCheckpointStore>>,
    maintenance: Arc<MaintenanceThreads>,
    /// Where the run started, for its job directory's `RUN_ORIGIN`: recorded once the first
    /// attempt's shards are built (every operator took its restored state, every sink accepted
    /// it), before any record moves, and taken from here then.
    origin: Arc<Mutex<Option<weir_io::RunOrigin>>>,
}

/// Starts `graph` on `config.shards` shards.
pub(crate) fn start(config: JobConfig, graph: Graph) -> Result<JobHandle, StartError> {
    config.validate()?;
    crate::platform::check_memlock()?;
    crate::platform::check_descriptors(config.shards)?;
    crate::platform::check_io_uring()?;
    let (state_dir, tmp) = match &config.state_dir {
        Some(d) => (d.clone(), None),
        None => {
            let t = tempfile::Builder::new()
                .prefix("weir-state-")
                .tempdir()
                .map_err(|source| StartError::StateDir {
                    path: std::env::temp_dir(),
                    source,
                })?;
            (t.path().to_path_buf(), Some(t))
        }
    };
    let sentinel = crate::platform::write_sentinel(&state_dir)?;
    let shards = config.shards;
    let claim = match config.pinning {
        Pinning::Auto => CoreClaim::take(shards),
        Pinning::Never => CoreClaim(Vec::new()),
    };
    let cores: Vec<Option<usize>> = (0..shards).map(|s| claim.0.get(s).copied()).collect();
    let placements = cores
        .iter()
        .map(|c| c.map_or(Placement::Unbound, Placement::Fixed))
        .collect();
    let store = match &config.checkpoint {
        Some(c) => {
            let fs: Arc<dyn weir_io::Fs> = match &c.fs {
                Some(fs) => fs.clone(),
                None => Arc::new(weir_io::UringFs::new().map_err(|e| {
                    StartError::IoUringUnavailable {
                        reason: e.to_string(),
                    }
                })?),
            };
            let options = crate::checkpoint::storage_options();
            let storage = weir_io::CheckpointStorage::open_with(fs, &c.dir, &c.job_id, options)
                .map_err(|e| StartError::Checkpoint {
                    reason: format!("{}: {e}", c.dir.join(&c.job_id).display()),
                })?;
            Some(Arc::new(IoCheckpointStore::new(storage)))
        }
        None => None,
    };
    let (restore, restored_from) = initial_restore(&config, store.as_deref())?;
    // Without checkpointing no id is ever taken, so none can run out.
    let first_id = match &store {
        Some(s) => first_checkpoint_id(s, restore.as_deref())?,
        None => 1,
    };
    // A later `latest` continues this run, from its checkpoints or else from where it
    // started, as its own failovers do. Recorded only once its start took (a restore that a
    // sink refuses leaves the record of the run before).
    let origin = store.as_ref().map(|_| weir_io::RunOrigin {
        first_id,
        restored: restore
            .as_ref()
            .zip(restored_from)
            .map(|(r, p)| (r.checkpoint_id, p)),
    });
    let ctl = Arc::new(Control {
        cancel: AtomicBool::new(false),
        finished: AtomicBool::new(false),
        metrics: Mutex::new(Registry::new()),
        checkpoints: Arc::new(Mutex::new(CheckpointMetrics::default())),
        requests: Arc::new(Requests::default()),
        restarts: AtomicU64::new(0),
        checkpointing: config.checkpoint.is_some(),
        status: Arc::new(StatusCell::new()),
    });
    note_restore(&ctl, restore.as_deref());
    let maintenance = Arc::new(MaintenanceThreads::default());
    let plan = Plan {
        config: Arc::new(config),
        roots: Arc::new(graph.roots),
        exchanges: graph.exchanges,
        state_dir,
        sentinel,
        placements,
        store,
        maintenance: maintenance.clone(),
        origin: Arc::new(Mutex::new(origin)),
    };
    let ctl2 = ctl.clone();
    let supervisor = std::thread::Builder::new()
        .name("weir-supervisor".into())
        .spawn(move || {
            let r = supervise(&plan, restore, first_id, &ctl2);
            // Free before the job is seen to end: a job started right after may pin there.
            drop(claim);
            let end = match &r {
                Ok(()) => JobStatus::Finished,
                Err(e) if e.is_cancellation() => JobStatus::Cancelled,
                Err(_) => JobStatus::Failed,
            };
            ctl2.status.set(end, ctl2.restarts.load(Ordering::Acquire));
            ctl2.finished.store(true, Ordering::Release);
            r
        })
        .map_err(|e| StartError::Executor {
            shard: 0,
            reason: format!("supervisor thread: {e}"),
        })?;
    Ok(JobHandle {
        supervisor: Some(supervisor),
        ctl,
        shards,
        cores,
        maintenance,
        _state_dir: tmp,
    })
}

/// The restore state the job starts from, as its configuration asks, and the absolute path
/// of the checkpoint or savepoint it is read from.
fn initial_restore(
    config: &JobConfig,
    store: Option<&IoCheckpointStore>,
) -> Result<(Option<Arc<RestoreState>>, Option<PathBuf>), StartError> {
    let err = |reason: String| StartError::Restore { reason };
    match &config.restore {
        None => Ok((None, None)),
        Some(RestoreFrom::Latest) => {
            let Some(store) = store else {
                return Err(err("`latest` needs a checkpoint directory".into()));
            };
            let job_dir = store.storage.job_dir();
            // Where the directory's newest run started: `latest` continues that run, from a
            // checkpoint it took, or else from what it restored. Without the record (a
            // directory of an older version), from any checkpoint.
            let origin = store.storage.run_origin().map_err(|e| {
                let what = match e {
                    weir_io::CheckpointError::Format(_) => "does not decode",
                    _ => "cannot be read",
                };
                err(format!(
                    "{e}: the record of where the last run started {what}, so which checkpoint \
                     continues it is unknown. Restore a checkpoint or savepoint by its path, or \
                     remove {} to restore the newest checkpoint (from the beginning if there \
                     is none)",
                    job_dir.join(weir_io::RUN_ORIGIN_FILE).display()
                ))
            })?;
            let min_id = origin.as_ref().map_or(0, |o| o.first_id);
            if let Some(r) = latest_restore(config, store, min_id)? {
                eprintln!("weir: restoring from checkpoint {}", r.checkpoint_id);
                let chk = job_dir.join(weir_io::checkpoint_dir_name(r.checkpoint_id));
                let path = weir_io::resolved_path(&chk);
                return Ok((Some(r), Some(path)));
            }
            let restored = origin.and_then(|o| o.restored);
            if min_id > 0 {
                // `latest_restore` passed over a damaged record, as a failover does; a run
                // continued in another process may not have been the last to commit. As
                // there: only where no checkpoint has a `_metadata` (beside one, a torn
                // record is a power cut's, and says nothing).
                let listed = store.storage.list().map_err(|e| err(e.to_string()))?;
                let metadata = listed.iter().any(|i| i.complete || i.metadata_corrupt);
                if let (Err(e), false) = (store.storage.completed_record(), metadata) {
                    let then = match restored {
                        Some(_) => "going back to what the last run restored",
                        None => "starting from the beginning",
                    };
                    damaged_record(config, store, &e, then)?;
                }
            }
            match restored {
                Some((id, path)) => {
                    eprintln!(
                        "weir: no checkpoint in {} since the last run started; restoring from {}, \
                         which it restored",
                        job_dir.display(),
                        path.display()
                    );
                    let r = restore_from_path(config, &path).and_then(|r| {
                        if r.checkpoint_id == id {
                            return Ok(r);
                        }
                        Err(err(format!(
                            "{}: holds checkpoint {}, but the last run restored checkpoint {id} \
                             from there",
                            path.display(),
                            r.checkpoint_id
                        )))
                    });
                    let r = r.map_err(|e| match e {
                        StartError::Restore { reason } => reason,
                        e => e.to_string(),
                    });
                    match r {
                        Ok(r) => Ok((Some(r), Some(path))),
                        Err(e) if config.allow_fallback => {
                            eprintln!("weir: {e}; starting from the beginning (fallback allowed)");
                            Ok((None, None))
                        }
                        Err(e) => Err(err(format!(
                            "{e}. The last run started from it and took no checkpoint since; \
                             starting from the beginning could duplicate output that a sink \
                             committed. Restore stops here; restore a checkpoint by its path, \
                             or allow starting over with --allow-fallback \
                             (JobConfig::with_allow_fallback)"
                        ))),
                    }
                }
                None if min_id > 0 => {
                    eprintln!(
                        "weir: no checkpoint in {} since the last run started from the \
                         beginning; starting from the beginning",
                        job_dir.display()
                    );
                    Ok((None, None))
                }
                None => {
                    eprintln!(
                        "weir: no complete checkpoint in {}; starting from the beginning",
                        job_dir.display()
                    );
                    Ok((None, None))
                }
            }
        }
        Some(RestoreFrom::Path(p)) => {
            let r = restore_from_path(config, p)?;
            Ok((Some(r), Some(weir_io::resolved_path(p))))
        }
    }
}

/// The newest complete checkpoint with an id of at least `min_id` that verifies. An older one
/// is used only where that cannot duplicate committed output (DESIGN invariant 4), or when the
/// user allowed it.
fn latest_restore(
    config: &JobConfig,
    store: &IoCheckpointStore,
    min_id: u64,
) -> Result<Option<Arc<RestoreState>>, StartError> {
    let err = |reason: String| StartError::Restore { reason };
    let infos = store.storage.list().map_err(|e| err(e.to_string()))?;
    tracing::debug!(
        "list: {:?}",
        infos.iter().map(|i| (i.id, i.complete)).collect::<Vec<_>>()
    );
    // Checkpoints that completed, and those whose metadata exists but is corrupt: a crash
    // never leaves a partial `_metadata` (written whole, synced, renamed), so such a
    // checkpoint did complete, and its sink transactions may be committed. Passing over it as
    // if it had not (starting from an older checkpoint, or from the beginning) could duplicate
    // that output.
    let mut candidates: Vec<&weir_io::CheckpointInfo> = infos
        .iter()
        .filter(|i| (i.complete || i.metadata_corrupt) && i.id >= min_id)
        .collect();
    candidates.sort_unstable_by_key(|i| i.id);
    let mut skipped: Vec<(u64, String)> = Vec::new();
    // The storage's record of the newest completed checkpoint: when no checkpoint that new
    // has a `_metadata`, one was removed after it completed, and is treated as one that does
    // not verify (the metadata of a checkpoint cut short by a crash never existed).
    let record = store.storage.completed_record();
    if let Some(done) = record
        .as_ref()
        .ok()
        .copied()
        .flatten()
        .filter(|&n| n >= min_id)
    {
        if !candidates.iter().any(|i| i.id >= done) {
            skipped.push((
                done,
                format!(
                    "checkpoint {done} completed ({} in {} names it) but its {} is gone",
                    weir_io::COMPLETED_FILE,
                    store.storage.job_dir().display(),
                    weir_io::METADATA_FILE
                ),
            ));
        }
    }
    for info in candidates.into_iter().rev() {
        let id = info.id;
        if info.metadata_corrupt {
            // The decode error names the file and offset.
            let problem = info
                .problem
                .clone()
                .unwrap_or_else(|| format!("its {} does not verify", weir_io::METADATA_FILE));
            skipped.push((id, problem));
            continue;
        }
        let attempt = store
            .storage
            .verify(id)
            .map_err(|e| e.to_string())
            .and_then(|_| store.storage.read_metadata(id).map_err(|e| e.to_string()))
            .and_then(|m| {
                RestoreState::decode(
                    &m,
                    Arc::new(StorageReader(store.storage.clone())),
                    config.shards,
                    config.max_parallelism,
                )
            })
            .map(|mut r| {
                r.files_in_job_storage = true;
                r
            });
        match attempt {
            Ok(r) => {
                if !skipped.is_empty() {
                    let has_transactions = r
                        .shards
                        .iter()
                        .flat_map(|s| s.parts.iter())
                        .any(|p| p.kind == PartKind::Sink && !p.bytes.is_empty());
                    if has_transactions && !config.allow_fallback {
                        let (bad, why) = &skipped[0];
                        return Err(err(format!(
                            "checkpoint {bad} does not verify ({why}); falling back to checkpoint {id} could duplicate \
                             output that a sink committed for checkpoint {bad}. Restore stops here; allow the fallback \
                             with --allow-fallback (JobConfig::with_allow_fallback) to accept that"
                        )));
                    }
                    for (bad, why) in &skipped {
                        eprintln!("weir: checkpoint {bad} does not verify ({why}); falling back");
                    }
                }
                return Ok(Some(Arc::new(r)));
            }
            Err(e) => skipped.push((id, e)),
        }
    }
    if let Some((bad, why)) = skipped.first() {
        return Err(err(format!(
            "no complete checkpoint verifies; the newest, {bad}: {why}"
        )));
    }
    // No checkpoint has a `_metadata`, and the record of the newest completed one exists but
    // does not decode. Only a completed checkpoint writes that record, after its metadata is
    // synced: a crash can tear the record but not take that metadata away, so it was removed
    // since, and its sinks may have committed. Starting from the beginning could commit
    // that output twice. (A failover, `min_id` > 0, goes back to where its run started.)
    if let (Err(e), 0) = (&record, min_id) {
        damaged_record(config, store, e, "starting from the beginning")?;
    }
    Ok(None)
}

/// A `COMPLETED` record that does not decode while no checkpoint it could name has a
/// `_metadata`: one completed and its metadata was removed since, and its sinks may have
/// committed. Going back (`then`: to the beginning, or to what the run restored) could commit
/// that output twice, so the restore stops unless the fallback is allowed.
fn damaged_record(
    config: &JobConfig,
    store: &IoCheckpointStore,
    e: &weir_io::CheckpointError,
    then: &str,
) -> Result<(), StartError> {
    let why = format!(
        "{e}: the record of the newest completed checkpoint does not decode, and no \
         checkpoint in {} has a {}: one completed and its metadata was removed since",
        store.storage.job_dir().display(),
        weir_io::METADATA_FILE
    );
    if !config.allow_fallback {
        return Err(StartError::Restore {
            reason: format!(
                "{why}; {then} could duplicate output that a sink committed for it. Restore \
                 stops here; allow it with --allow-fallback (JobConfig::with_allow_fallback)"
            ),
        });
    }
    eprintln!("weir: {why}; {then} (fallback allowed)");
    Ok(())
}

fn restore_from_path(config: &JobConfig, path: &Path) -> Result<Arc<RestoreState>, StartError> {
    let err = |reason: String| StartError::Restore {
        reason: format!("{}: {reason}", path.display()),
    };
    let fs: Arc<dyn weir_io::Fs> = Arc::new(weir_io::StdFs);
    // A checkpoint directory `<root>/<job>/chk-<n>`: read it through its job's storage, whose
    // shared files it references.
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or_default();
    // Only the spelling storage writes: `chk-04` is not checkpoint 4's directory.
    if let Some(n) = weir_io::parse_checkpoint_dir_name(name) {
        let job_dir = path
            .parent()
            .ok_or_else(|| err("no job directory".into()))?;
        let (root, job) = (
            job_dir
                .parent()
                .ok_or_else(|| err("no checkpoint root".into()))?,
            job_dir
                .file_name()
                .and_then(|n| n.to_str())
                .ok_or_else(|| err("bad job directory".into()))?,
        );
        let options = crate::checkpoint::storage_options();
        let storage = weir_io::CheckpointStorage::open_read_only_with(fs, root, job, options)
            .map_err(|e| err(e.to_string()))?;
        storage.verify(n).map_err(|e| err(e.to_string()))?;
        let m = storage.read_metadata(n).map_err(|e| err(e.to_string()))?;
        let r = RestoreState::decode(
            &m,
            Arc::new(StorageReader(storage)),
            config.shards,
            config.max_parallelism,
        )
        .map_err(err)?;
        return Ok(Arc::new(r));
    }
    let sp = weir_io::Savepoint::open(fs, path)
        .map_err(|e| err(e.to_string()))?
        .with_raw_diagnose(weir_state::diagnose_segment);
    sp.verify().map_err(|e| err(e.to_string()))?;
    let m = sp.metadata().clone();
    let r = RestoreState::decode(
        &m,
        Arc::new(SavepointReader(sp)),
        config.shards,
        config.max_parallelism,
    )
    .map_err(err)?;
    Ok(Arc::new(r))
}

/// Runs attempts until one ends well, the user cancels, or the restart strategy gives up.
/// `first_id` is the run's first checkpoint id ([`first_checkpoint_id`] when it started).
fn supervise(
    plan: &Plan,
    mut restore: Option<Arc<RestoreState>>,
    first_id: u64,
    ctl: &Control,
) -> Result<(), JobError> {
    let mut backoff = Backoff::default();
    // A failover restores this run's newest checkpoint; before the run has one, what the run
    // started from (Flink: the savepoint it was started from), never a checkpoint an earlier
    // run left in the directory.
    let initial = restore.clone();
    loop {
        let r = run_attempt(plan, restore.clone(), ctl);
        let e = match r {
            Ok(()) => return Ok(()),
            Err(e) if ctl.cancel.load(Ordering::Acquire) => {
                return Err(if e.is_cancellation() {
                    JobError::Cancelled
                } else {
                    e
                })
            }
            Err(e) => e,
        };
        let Some(ck) = &plan.config.checkpoint else {
            return Err(e);
        };
        if !e.is_recoverable() {
            return Err(e);
        }
        // Jitter from the clock's low bits: spreads restarts of many jobs apart.
        let noise = (crate::checkpoint::coordinator::now_ms() % 1000) as f64 / 1000.0 * 2.0 - 1.0;
        let restarts = ctl.restarts.load(Ordering::Acquire);
        let Some(wait) = backoff.next(&ck.restart, restarts, Instant::now(), noise) else {
            return Err(e);
        };
        ctl.status.set(JobStatus::Restarting, restarts);
        tracing::warn!("job failed ({e}); restarting in {wait:?}");
        eprintln!("weir: job failed: {e}; restarting in {wait:?}");
        // Validation bounds the delay, but one past what an `Instant` holds waits for a
        // cancel rather than panicking.
        let until = Instant::now().checked_add(wait);
        while until.is_none_or(|u| Instant::now() < u) {
            if ctl.cancel.load(Ordering::Acquire) {
                return Err(JobError::Cancelled);
            }
            let left = until.map_or(Duration::MAX, |u| {
                u.saturating_duration_since(Instant::now())
            });
            std::thread::sleep(Duration::from_millis(5).min(left));
        }
        let store = plan.store.as_deref().ok_or(e)?;
        restore = latest_restore(&plan.config, store, first_id)
            .map_err(JobError::Start)?
            .or_else(|| initial.clone());
        note_restore(ctl, restore.as_deref());
        ctl.restarts.fetch_add(1, Ordering::AcqRel);
    }
}

/// What the restart strategy remembers between failures.
#[derive(Default)]
struct Backoff {
    /// When failures happened (failure rate).
    failures: Vec<Instant>,
    /// The exponential delay's last base delay, and when the restart it delayed was due.
    delay: Option<(Duration, Instant)>,
}

impl Backoff {
    /// The delay before the restart after a failure at `now`, when the job restarted
    /// `restarts` times before; `None`: the strategy gives up. `noise`, within -1..=1, scales
    /// the exponential delay's jitter. Overflow-free for any strategy, validated or not: a
    /// delay grown past what a `Duration` holds is the strategy's `max`.
    fn next(
        &mut self,
        strategy: &RestartStrategy,
        restarts: u64,
        now: Instant,
        noise: f64,
    ) -> Option<Duration> {
        self.failures.push(now);
        match strategy {
            RestartStrategy::None => None,
            RestartStrategy::FixedDelay { attempts, delay } => {
                (restarts < u64::from(*attempts)).then_some(*delay)
            }
            RestartStrategy::FailureRate {
                max_failures,
                interval,
                delay,
            } => {
                self.failures
                    .retain(|t| now.duration_since(*t) <= *interval);
                (self.failures.len() <= *max_failures as usize).then_some(*delay)
            }
            RestartStrategy::ExponentialDelay {
                initial,
                max,
                multiplier,
                jitter,
                reset_after,
            } => {
                // The delay resets once the job ran `reset_after` since its last restart, as
                // Flink's: counted from the failure, a delay grown past `reset_after` reset
                // itself every time, and the backoff cycled instead of growing.
                let base = match self.delay {
                    Some((d, restarted))
                        if now.saturating_duration_since(restarted) < *reset_after =>
                    {
                        scale(d, *multiplier).map_or(*max, |g| g.min(*max))
                    }
                    _ => *initial,
                };
                let delay = scale(base, (1.0 + jitter * noise).max(0.0)).unwrap_or(base);
                self.delay = Some((base, now.checked_add(delay).unwrap_or(now)));
                Some(delay)
            }
        }
    }
}

/// `d * factor`, or `None` where that is no `Duration` (too large, negative, not a number):
/// `Duration::mul_f64` panics there.
fn scale(d: Duration, factor: f64) -> Option<Duration> {
    Duration::try_from_secs_f64(d.as_secs_f64() * factor).ok()
}

/// Records in the checkpoint metrics that an attempt restores `restore`, if it does.
fn note_restore(ctl: &Control, restore: Option<&RestoreState>) {
    if let Some(r) = restore {
        let mut m = lock(&ctl.checkpoints);
        m.last_checkpoint_restore_timestamp = Some(crate::checkpoint::coordinator::now_ms());
        m.last_restored_checkpoint_id = Some(r.checkpoint_id);
    }
}

/// The first checkpoint id of an attempt: past every id the storage lists, the restored one
/// and every id an earlier attempt of this job began. Past `u64::MAX` there is none: wrapping
/// to 0 would make every checkpoint "not newer" than the complete ones, and taking an id
/// again would mix two checkpoints' files, so the attempt does not start.
fn first_checkpoint_id(
    store: &IoCheckpointStore,
    restore: Option<&RestoreState>,
) -> Result<u64, StartError> {
    let listed = store.storage.list().ok();
    let listed = listed.map_or(0, |l| l.iter().map(|i| i.id).max().unwrap_or(0));
    let restored = restore.map_or(0, |r| r.checkpoint_id);
    let newest = listed.max(store.highest_begun()).max(restored);
    newest.checked_add(1).ok_or_else(|| {
        let whence = if listed == newest {
            format!("it holds chk-{newest} (every chk-N counts, with or without _metadata)")
        } else if restored == newest {
            format!("the checkpoint restored is {newest}")
        } else {
            format!("checkpoint {newest} was begun")
        };
        StartError::Checkpoint {
            reason: format!(
                "{}: checkpoint ids are exhausted: {whence}, the largest id, and ids never \
                 repeat. Remove a stray chk-{newest}, or checkpoint into another directory",
                store.storage.job_dir().display()
            ),
        }
    })
}

fn run_attempt(
    plan: &Plan,
    restore: Option<Arc<RestoreState>>,
    ctl: &Control,
) -> Result<(), JobError> {
    let shards = plan.config.shards;
    let registry = Registry::new();
    *lock(&ctl.metrics) = registry.clone();
    // The first attempt's `Initializing` is the history's first entry, from the start.
    let attempt = ctl.restarts.load(Ordering::Acquire);
    if ctl.status.get() != JobStatus::Initializing {
        ctl.status.set(JobStatus::Initializing, attempt);
    }
    // Each attempt builds its executors anew, and glommio leaks a descriptor per executor
    // (README, Known limitations): checked on every attempt (the first also at start, before
    // any directory is made), so that a restart near the limit ends the job with the typed
    // error, not in glommio's panics. Under the process's build lock, held until this
    // attempt's executors exist, so that another job's check counts them.
    let builds = crate::platform::executor_builds();
    crate::platform::check_descriptors(shards).map_err(JobError::Start)?;
    let cancel = Arc::new(AtomicBool::new(false));
    let running = Arc::new(AtomicUsize::new(shards));
    // Shards whose operators are built (state restored, memory faulted in), and whether the
    // job may run once all are ([`check_restored`]).
    let built = Arc::new(AtomicUsize::new(0));
    let verdict = Arc::new(AtomicU8::new(VERDICT_PENDING));
    // This thread watches the attempt; a shard that ends wakes it.
    let supervisor = std::thread::current();
    let endpoints = crate::exchange::wire(plan.exchanges, shards, plan.config.ring_capacity_bytes);
    // Checkpointing: the shared state and the coordinator thread.
    let (shared, coordinator, failure) = match (&plan.config.checkpoint, &plan.store) {
        (Some(c), Some(store)) => {
            let (tx, rx) = mpsc::channel();
            let first = first_checkpoint_id(store, restore.as_deref()).map_err(JobError::Start)?;
            let shared = Arc::new(Shared {
                config: c.clone(),
                requested: AtomicU64::new(first - 1),
                completed: AtomicU64::new(first - 1),
                // The checkpoint restored from, if it is this job's own: complete, and its
                // shared files may be reused (see `RestoreState::files_in_job_storage`).
                completed_ids: Mutex::new(
                    restore
                        .as_deref()
                        .filter(|r| r.files_in_job_storage)
                        .map(|r| r.checkpoint_id)
                        .into_iter()
                        .collect(),
                ),
                aborted: AtomicU64::new(0),
                sources_total: AtomicUsize::new(0),
                sources_finished: AtomicUsize::new(0),
                shards_ready: AtomicUsize::new(0),
                final_id: AtomicU64::new(0),
                stop_at: AtomicU64::new(0),
                stop_go: AtomicU64::new(0),
                stopping: AtomicBool::new(false),
                store: store.clone(),
                acks: Mutex::new(tx),
            });
            let failure = Arc::new(Mutex::new(None));
            let coord = Coordinator::new(
                shared.clone(),
                shards,
                plan.config.max_parallelism,
                rx,
                first,
                ctl.requests.clone(),
                ctl.checkpoints.clone(),
                failure.clone(),
            );
            let t = std::thread::Builder::new()
                .name("weir-coordinator".into())
                .spawn(move || coord.run())
                .map_err(|e| {
                    JobError::Start(StartError::Executor {
                        shard: 0,
                        reason: format!("coordinator thread: {e}"),
                    })
                })?;
            (Some(shared), Some(t), Some(failure))
        }
        _ => (None, None, None),
    };
    let epoch = Instant::now();
    let mut threads = Vec::with_capacity(shards);
    let mut spawn_error = None;
    let (executors_tx, executors_rx) = mpsc::channel::<()>();
    // Closures spawned so far, each of which signals once.
    let mut settled = 0;
    for (shard, exchanges) in endpoints.into_iter().enumerate() {
        let (built, verdict, supervisor, status) = (
            built.clone(),
            verdict.clone(),
            supervisor.clone(),
            ctl.status.clone(),
        );
        let maintenance = plan.maintenance.clone();
        let origin = (plan.origin.clone(), plan.store.clone());
        let (config, roots, registry, cancel2, running2, sentinel, state_dir, shared, restore) = (
            plan.config.clone(),
            plan.roots.clone(),
            registry.clone(),
            cancel.clone(),
            running.clone(),
            plan.sentinel.clone(),
            plan.state_dir.clone(),
            shared.clone(),
            restore.clone(),
        );
        // Moved into the closure, not made inside the future: glommio builds the executor on
        // the new thread before it calls the closure, and a panic there (io_uring setup, say)
        // then drops the closure, and the guard with it. Made in the future, it never
        // existed, the count never dropped, and the job waited for good in Initializing.
        let exit = ShardExit {
            cancel: cancel2.clone(),
            running: running2,
            supervisor,
            ran: false,
        };
        let mut built_here = ExecutorBuilt(Some(executors_tx.clone()));
        let spawned = LocalExecutorBuilder::new(plan.placements[shard].clone())
            .name(&format!("weir-shard-{shard}"))
            .io_memory(config.io_memory_bytes)
            .spawn(move || {
                // glommio calls this once the executor is built.
                built_here.signal();
                async move {
                    let mut exit = exit;
                    crate::platform::set_fine_timer_slack();
                    let r = async {
                        crate::platform::dma_probe(&sentinel, shard).await?;
                        let mut ctx = BuildCtx {
                            shard,
                            shards: config.shards,
                            config: config.clone(),
                            heads: Vec::new(),
                            gate: Default::default(),
                            exchanges,
                            metrics: registry,
                            fail: FailCell::default(),
                            state_dir,
                            real_io: true,
                            states: Vec::new(),
                            checkpoint: shared
                                .as_ref()
                                .map(|s| ShardCheckpoint::new(s.clone(), shard)),
                            restore,
                            epoch,
                            maintenance,
                            split_tags: Vec::new(),
                            stop: cancel2.clone(),
                        };
                        for root in roots.iter() {
                            root(&mut ctx)?;
                            ctx.gate = std::rc::Rc::new(Gate::default());
                        }
                        if let Some(s) = &shared {
                            s.shards_ready.fetch_add(1, Ordering::AcqRel);
                        }
                        // No shard runs before every shard is built: a source would otherwise
                        // fill the rings of a shard still restoring its state, and those records
                        // would wait out the restore. The last one built checks that the restore
                        // found an operator for every state it holds, before any record moves.
                        if built.fetch_add(1, Ordering::AcqRel) + 1 == config.shards {
                            if let Some(r) = ctx.restore.as_deref() {
                                if let Err(e) = check_restored(&config, r) {
                                    verdict.store(VERDICT_REFUSED, Ordering::Release);
                                    return Err(JobError::Start(e));
                                }
                            }
                            if let Err(e) = record_origin(&origin.0, origin.1.as_deref()) {
                                verdict.store(VERDICT_REFUSED, Ordering::Release);
                                return Err(JobError::Start(e));
                            }
                            verdict.store(VERDICT_OK, Ordering::Release);
                            status.set(JobStatus::Running, attempt);
                        }
                        loop {
                            match verdict.load(Ordering::Acquire) {
                                VERDICT_OK => break,
                                VERDICT_REFUSED => return Err(JobError::Cancelled),
                                _ => {}
                            }
                            if cancel2.load(Ordering::Acquire) {
                                return Err(JobError::Cancelled);
                            }
                            nap(Duration::from_micros(100)).await;
                        }
                        run_loop(ctx, &cancel2).await
                    }
                    .await;
                    if r.is_err() {
                        cancel2.store(true, Ordering::Release);
                    }
                    exit.ran = true;
                    r
                }
            });
        settled += 1;
        match spawned {
            Ok(t) => threads.push(t),
            Err(e) => {
                cancel.store(true, Ordering::Release);
                spawn_error = Some(JobError::Start(StartError::Executor {
                    shard,
                    reason: e.to_string(),
                }));
                break;
            }
        }
    }
    // Watch for the user's cancel and for checkpoint failures beyond the tolerable number.
    // Every shard's executor is built, or its thread ended without one (each closure signals
    // once, when called or when dropped uncalled): other jobs may build theirs now.
    drop(executors_tx);
    for _ in 0..settled {
        if executors_rx.recv().is_err() {
            break;
        }
    }
    drop(builds);
    let mut first: Option<JobError> = spawn_error;
    while running.load(Ordering::Acquire) > 0 && first.is_none() {
        if ctl.cancel.load(Ordering::Acquire) {
            cancel.store(true, Ordering::Release);
            break;
        }
        if let Some(f) = failure.as_ref().and_then(|f| lock(f).clone()) {
            first = Some(JobError::CheckpointFailures { reason: f });
            cancel.store(true, Ordering::Release);
            break;
        }
        // Woken at once when a shard ends or the user cancels; the timeout bounds how late a
        // checkpoint failure is noticed. Polling every few milliseconds instead preempted a
        // busy shard hundreds of times a second, on machines with no spare core.
        std::thread::park_timeout(Duration::from_millis(20));
    }
    for (shard, t) in threads.into_iter().enumerate() {
        let r = match t.join() {
            Ok(r) => r,
            Err(glommio::GlommioError::BuilderError(glommio::BuilderErrorKind::ThreadPanic(p))) => {
                Err(JobError::Panic {
                    shard,
                    message: panic_message(&*p),
                })
            }
            Err(e) => Err(JobError::Start(StartError::Executor {
                shard,
                reason: e.to_string(),
            })),
        };
        if let Err(e) = r {
            match &first {
                None => first = Some(e),
                Some(f) if f.is_cancellation() && !e.is_cancellation() => first = Some(e),
                _ => {}
            }
        }
    }
    if let Some(s) = &shared {
        s.stopping.store(true, Ordering::Release);
    }
    if let Some(t) = coordinator {
        let _ = t.join();
    }
    match first {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// Writes the run's `RUN_ORIGIN` if no attempt did yet (see [`Plan::origin`]); a failure to
/// write it fails the job: a later `latest` would not know where this run started.
fn record_origin(
    origin: &Mutex<Option<weir_io::RunOrigin>>,
    store: Option<&IoCheckpointStore>,
) -> Result<(), StartError> {
    let mut pending = lock(origin);
    let (Some(o), Some(s)) = (pending.as_ref(), store) else {
        return Ok(());
    };
    s.storage
        .record_run_origin(o)
        .map_err(|e| StartError::Checkpoint {
            reason: format!("{}: {e}", s.storage.job_dir().display()),
        })?;
    *pending = None;
    Ok(())
}

/// [`run_attempt`]'s verdict on the built shards: not yet given, run, or refused.
const VERDICT_PENDING: u8 = 0;
const VERDICT_OK: u8 = 1;
const VERDICT_REFUSED: u8 = 2;

/// Refuses a restore that would drop state: state in the checkpoint of an operator (uid and
/// kind) that no operator of the job asked for while the shards were built, as Flink refuses
/// it without `--allowNonRestoredState`. A renamed uid, a changed job or the wrong
/// checkpoint would otherwise start that operator afresh and say nothing.
fn check_restored(config: &JobConfig, r: &RestoreState) -> Result<(), StartError> {
    let unclaimed = r.unclaimed();
    if unclaimed.is_empty() {
        return Ok(());
    }
    // A line, however many operators a foreign checkpoint holds.
    const SHOWN: usize = 16;
    let mut names = unclaimed
        .iter()
        .take(SHOWN)
        .map(|(op, kind)| format!("`{}` ({})", op.escape_debug(), kind.name()))
        .collect::<Vec<_>>()
        .join(", ");
    if unclaimed.len() > SHOWN {
        names.push_str(&format!(" and {} more", unclaimed.len() - SHOWN));
    }
    if config.allow_non_restored_state {
        eprintln!(
            "weir: checkpoint {}: skipping the state of {names}: the job has no such operator",
            r.checkpoint_id
        );
        return Ok(());
    }
    Err(StartError::Restore {
        reason: format!(
            "checkpoint {} holds state of operators this job does not have: {names}. If they \
             were removed on purpose, skip their state with --allow-non-restored-state \
             (JobConfig::with_allow_non_restored_state)",
            r.checkpoint_id
        ),
    })
}

/// Wall-clock milliseconds: processing time.
pub(crate) fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// The name of the head-metrics entry whose backpressured time is the time a shard stopped
/// because a state store's flushes lagged behind (`weir_state::Store::write_stalled`).
pub const STATE_STALL: &str = "state write stall";

/// Installs finished state maintenance, hands out the next, and completes checkpoints.
/// Maintenance between steps; `Stop` once the shard told its sinks of the completion of a
/// stop-with-savepoint's checkpoint.
fn maintain(ctx: &BuildCtx) -> Result<Continue, JobError> {
    for s in &ctx.states {
        s.maintain()?;
    }
    if let Some(c) = &ctx.checkpoint {
        ShardCheckpoint::poll_completed(c);
        if let Some(e) = ctx.fail.take() {
            return Err(e);
        }
        if ShardCheckpoint::stop_reached(c) {
            return Ok(Continue::Stop);
        }
    }
    Ok(Continue::Run)
}

/// Whether a shard's loop goes on after [`maintain`].
#[derive(PartialEq, Eq)]
enum Continue {
    Run,
    Stop,
}

async fn run_loop(mut ctx: BuildCtx, cancel: &AtomicBool) -> Result<(), JobError> {
    let mut heads = std::mem::take(&mut ctx.heads);
    let mut done = vec![false; heads.len()];
    let mut idle_rounds = 0u32;
    let sleep_max = Duration::from_micros(ctx.config.idle_sleep_max_us);
    let mut sleep = Duration::from_micros(10).min(sleep_max);
    let mut stall = None;
    loop {
        if cancel.load(Ordering::Acquire) {
            return Err(JobError::Cancelled);
        }
        // Back-pressure from state: while a store's flushes lag behind (too many frozen
        // memtables, `Store::write_stalled`), no head runs, so upstream rings fill and the
        // producers wait; maintenance and checkpoint completions go on, and end the stall.
        // Its time shows as the backpressured time of the shard's `STATE_STALL` entry.
        if ctx.states.iter().any(|s| s.write_stalled()) {
            let t0 = Instant::now();
            if maintain(&ctx)? == Continue::Stop {
                return Ok(());
            }
            nap(Duration::from_micros(100)).await;
            let stall = stall.get_or_insert_with(|| ctx.metrics.head(STATE_STALL, ctx.shard));
            crate::metrics::bump(&stall.backpressured_ns, t0.elapsed().as_nanos() as u64);
            continue;
        }
        let now = now_ms();
        let mut progress = false;
        let mut live = 0;
        for (h, d) in heads.iter_mut().zip(done.iter_mut()) {
            if *d {
                continue;
            }
            // A panic in user code fails the job with its message (the shard's thread stays
            // up long enough to report it and to stop the other shards).
            let status =
                match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| h.step(now))) {
                    Ok(r) => r?,
                    Err(p) => {
                        return Err(JobError::Panic {
                            shard: ctx.shard,
                            message: in_chain(&*p, h.name()),
                        })
                    }
                };
            if let Some(e) = ctx.fail.take() {
                return Err(e);
            }
            match status {
                HeadStatus::Progress => {
                    progress = true;
                    live += 1;
                }
                HeadStatus::Idle | HeadStatus::Blocked => live += 1,
                HeadStatus::Done => *d = true,
            }
        }
        if maintain(&ctx)? == Continue::Stop || live == 0 {
            return Ok(());
        }
        if progress {
            idle_rounds = 0;
            sleep = Duration::from_micros(10).min(sleep_max);
            glommio::yield_if_needed().await;
        } else {
            idle_rounds += 1;
            if idle_rounds < IDLE_SPIN_ROUNDS || sleep_max.is_zero() {
                std::hint::spin_loop();
                glommio::executor().yield_now().await;
            } else {
                nap(sleep).await;
                sleep = (sleep * 2).min(sleep_max);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::store::CheckpointStore;

    /// An attempt checks descriptors and builds its executors only while it holds the
    /// process's build lock: with another start between its check and its builds, it waits,
    /// so that its check counts the other's executors (else both count the same descriptors as
    /// free, and near the limit both pass into glommio's panics).
    #[test]
    fn an_attempt_waits_while_another_start_builds_its_executors() {
        let other = crate::platform::executor_builds();
        let job = crate::Job::new(
            crate::JobConfig::new()
                .with_shards(1)
                .with_pinning(crate::Pinning::Never),
        );
        let out = job.from_vec(vec![1u64, 2, 3]).collect();
        let h = job.start().expect("start");
        std::thread::sleep(Duration::from_millis(300));
        assert!(!h.is_finished(), "the job ran while another start built");
        assert_eq!(h.status(), JobStatus::Initializing);
        drop(other);
        h.wait().expect("the job");
        assert_eq!(out.take(), vec![1, 2, 3]);
    }

    /// A checkpoint store of job `job` in `dir`.
    fn store_in(dir: &Path) -> IoCheckpointStore {
        let fs: Arc<dyn weir_io::Fs> = Arc::new(weir_io::StdFs);
        let storage = weir_io::CheckpointStorage::open(fs, dir, "job").expect("storage");
        IoCheckpointStore::new(storage)
    }

    /// A checkpoint that an attempt began and aborted leaves nothing the storage lists, yet a
    /// restarted attempt must not take its id again: a straggling upload of the failed attempt
    /// would land in the new checkpoint of that id.
    #[test]
    fn a_restarted_attempt_never_reuses_a_checkpoint_id_begun_before() {
        let tmp = tempfile::tempdir().expect("tmp");
        let store = store_in(tmp.path());
        assert_eq!(first_checkpoint_id(&store, None).expect("id"), 1);
        store.begin(1).expect("begin 1");
        store.commit(1, 1, Vec::new()).expect("commit 1");
        store.begin(2).expect("begin 2");
        store.abort(2);
        let listed: Vec<u64> = store
            .storage
            .list()
            .expect("list")
            .iter()
            .map(|i| i.id)
            .collect();
        assert_eq!(listed, [1], "the aborted checkpoint leaves nothing listed");
        assert_eq!(first_checkpoint_id(&store, None).expect("id"), 3);
    }

    /// A stray `chk-18446744073709551615` (the storage lists every `chk-N`, with or without
    /// `_metadata`, so that ids never repeat) leaves no id: the id used to wrap to 0, and the
    /// job restarted forever with "checkpoint 0 is not newer than ...". The error names the
    /// directory and the id.
    #[test]
    fn checkpoint_ids_past_u64_max_are_exhausted_not_wrapped() {
        let tmp = tempfile::tempdir().expect("tmp");
        let store = store_in(tmp.path());
        let job_dir = store.storage.job_dir().to_path_buf();
        std::fs::create_dir(job_dir.join(format!("chk-{}", u64::MAX - 1))).expect("mkdir");
        assert_eq!(first_checkpoint_id(&store, None).expect("id"), u64::MAX);
        std::fs::create_dir(job_dir.join(format!("chk-{}", u64::MAX))).expect("mkdir");
        match first_checkpoint_id(&store, None) {
            Err(StartError::Checkpoint { reason }) => {
                assert!(
                    reason.contains(&job_dir.display().to_string())
                        && reason.contains(&format!("chk-{}", u64::MAX))
                        && reason.contains("exhausted"),
                    "{reason}"
                );
            }
            other => panic!("expected ids to be exhausted, got {other:?}"),
        }
    }

    /// Every shard thread runs with the 1-us timer slack that its naps rely on
    /// (`platform::nap`): a map on each shard reads its thread's slack.
    #[test]
    fn shard_threads_run_with_a_fine_timer_slack() {
        let job = crate::Job::new(JobConfig::new().with_shards(2).with_pinning(Pinning::Never));
        let out = job
            .from_iter(|shard, _| std::iter::once(shard as u64))
            .map(|shard| {
                // SAFETY: PR_GET_TIMERSLACK takes no argument and returns the calling thread's
                // slack.
                let slack = unsafe { libc::prctl(libc::PR_GET_TIMERSLACK, 0, 0, 0, 0) };
                (shard, slack as u64)
            })
            .collect();
        job.run().expect("job");
        let mut got = out.take();
        got.sort();
        assert_eq!(got, vec![(0, 1_000), (1, 1_000)]);
    }

    /// The exponential delay resets only once the job ran `reset_after` since its restart,
    /// as Flink's: the audit's attempts, each failing 30 ms after it started, got 200, 400,
    /// 800, then 200 ms again under a 500 ms reset, because the delay itself counted as
    /// quiet time.
    #[test]
    fn the_exponential_delay_grows_while_attempts_fail_soon_after_they_start() {
        let ms = Duration::from_millis;
        let s = RestartStrategy::ExponentialDelay {
            initial: ms(200),
            max: ms(3200),
            multiplier: 2.0,
            jitter: 0.0,
            reset_after: ms(500),
        };
        let mut b = Backoff::default();
        let mut now = Instant::now();
        let mut waits = Vec::new();
        for i in 0..6 {
            now += ms(30);
            let d = b.next(&s, i, now, 0.0).expect("restarts");
            waits.push(d);
            now += d;
        }
        assert_eq!(waits, [200, 400, 800, 1600, 3200, 3200].map(ms));
        // An attempt that ran 500 ms resets it.
        assert_eq!(b.next(&s, 6, now + ms(500), 0.0), Some(ms(200)));
    }

    /// Restart delays of any strategy, validated or not, never panic: a delay grown past what
    /// a `Duration` holds is the strategy's max (`Duration::mul_f64` panicked at the second
    /// failure under `multiplier = inf` or `1e300`), jitter that is no number adds none, and
    /// a delay past what an `Instant` holds has no deadline (the supervisor waits for a
    /// cancel).
    #[test]
    fn restart_delays_never_overflow() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let hour = Duration::from_secs(3600);
        let exp = |initial, max, multiplier, jitter| RestartStrategy::ExponentialDelay {
            initial,
            max,
            multiplier,
            jitter,
            reset_after: hour,
        };
        // Flink's growth, up to the max.
        let s = exp(ms(1), ms(50), 2.0, 0.0);
        let mut b = Backoff::default();
        let waits: Vec<Duration> = (0..8)
            .map(|i| b.next(&s, i, t0 + ms(i), 0.0).expect("restarts"))
            .collect();
        assert_eq!(waits, [1, 2, 4, 8, 16, 32, 50, 50].map(ms));
        // Reset after running `reset_after` since the last restart (due at 7 + 50 ms).
        assert_eq!(b.next(&s, 8, t0 + ms(56) + hour, 0.0), Some(ms(50)));
        let mut b = Backoff::default();
        for i in 0..8 {
            b.next(&s, i, t0 + ms(i), 0.0);
        }
        assert_eq!(b.next(&s, 8, t0 + ms(57) + hour, 0.0), Some(ms(1)));
        for m in [f64::MAX, 1e300, f64::INFINITY, f64::NAN] {
            let s = exp(ms(1), ms(50), m, 0.1);
            let mut b = Backoff::default();
            assert_eq!(b.next(&s, 0, t0, 0.0), Some(ms(1)), "multiplier {m}");
            assert_eq!(b.next(&s, 1, t0, 0.0), Some(ms(50)), "multiplier {m}");
            let jittered = b.next(&s, 2, t0, 1.0).expect("restarts");
            assert!(jittered > ms(54) && jittered < ms(56), "{jittered:?}");
        }
        let s = exp(ms(1), ms(50), 2.0, f64::INFINITY);
        let mut b = Backoff::default();
        assert_eq!(b.next(&s, 0, t0, 1.0), Some(ms(1)), "infinite jitter: none");
        assert_eq!(b.next(&s, 1, t0, -1.0), Some(Duration::ZERO));
        let s = exp(Duration::MAX, Duration::MAX, 2.0, 0.5);
        let mut b = Backoff::default();
        assert_eq!(b.next(&s, 0, t0, 1.0), Some(Duration::MAX));
        assert_eq!(b.next(&s, 1, t0, 1.0), Some(Duration::MAX));
        let s = RestartStrategy::FixedDelay {
            attempts: 1,
            delay: Duration::MAX,
        };
        let mut b = Backoff::default();
        assert_eq!(b.next(&s, 0, t0, 0.0), Some(Duration::MAX));
        assert_eq!(b.next(&s, 1, t0, 0.0), None, "one attempt");
        assert_eq!(Instant::now().checked_add(Duration::MAX), None);
    }
}
