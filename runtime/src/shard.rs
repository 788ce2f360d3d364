//! Shards: one glommio executor thread each, driving the heads of every chain built on it.
//!
//! A shard's loop steps each head in turn. A head that moved data is stepped again right away
//! (yielding to glommio when its time slice is used up); when no head moved anything the shard
//! backs off, first by spinning briefly, then by sleeping with a growing interval, so that more
//! shards than cores (tests run 4 shards on 2 cores) still share the machine fairly.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use glommio::{LocalExecutorBuilder, Placement};

use crate::config::{JobConfig, Pinning};
use crate::error::{JobError, StartError};
use crate::graph::{BuildCtx, FailCell, Gate, Graph, HeadStatus, Root};
use crate::metrics::{JobMetrics, Registry};

/// The longest a shard sleeps when it has nothing to do.
const IDLE_SLEEP_MAX: Duration = Duration::from_millis(1);
/// Rounds without progress before a shard starts sleeping.
const IDLE_SPIN_ROUNDS: u32 = 64;

/// A running job.
pub struct JobHandle {
    threads: Vec<glommio::ExecutorJoinHandle<Result<(), JobError>>>,
    cancel: Arc<AtomicBool>,
    running: Arc<AtomicUsize>,
    metrics: Arc<Registry>,
    shards: usize,
    _state_dir: Option<tempfile::TempDir>,
}

/// What a finished job reports.
#[derive(Clone, Debug)]
pub struct JobSummary {
    pub shards: usize,
    pub metrics: JobMetrics,
}

impl JobHandle {
    /// Waits until every shard finished. Returns the first real failure (not the cancellations
    /// that it caused on other shards).
    pub fn wait(mut self) -> Result<JobSummary, JobError> {
        let mut first: Option<JobError> = None;
        for (shard, t) in std::mem::take(&mut self.threads).into_iter().enumerate() {
            let r = match t.join() {
                Ok(r) => r,
                Err(glommio::GlommioError::BuilderError(
                    glommio::BuilderErrorKind::ThreadPanic(p),
                )) => Err(JobError::Panic {
                    shard,
                    message: panic_message(&p),
                }),
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
        match first {
            Some(e) => Err(e),
            None => Ok(JobSummary {
                shards: self.shards,
                metrics: self.metrics.snapshot(),
            }),
        }
    }

    /// Asks every shard to stop; [`JobHandle::wait`] then returns [`JobError::Cancelled`].
    pub fn cancel(&self) {
        self.cancel.store(true, Ordering::Relaxed);
    }

    /// True once every shard's loop ended.
    pub fn is_finished(&self) -> bool {
        self.running.load(Ordering::Acquire) == 0
    }

    /// A snapshot of the job's metrics.
    pub fn metrics(&self) -> JobMetrics {
        self.metrics.snapshot()
    }

    pub fn shards(&self) -> usize {
        self.shards
    }
}

impl Drop for JobHandle {
    fn drop(&mut self) {
        if !self.threads.is_empty() {
            self.cancel();
            for t in std::mem::take(&mut self.threads) {
                let _ = t.join();
            }
        }
    }
}

fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "panic with a non-text payload".to_string()
    }
}

/// Sets the cancel flag when a shard's thread unwinds, so that the other shards stop instead of
/// waiting forever on its rings.
struct CancelOnPanic(Arc<AtomicBool>);

impl Drop for CancelOnPanic {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.store(true, Ordering::Relaxed);
        }
    }
}

/// Starts `graph` on `config.shards` shards.
pub(crate) fn start(config: JobConfig, graph: Graph) -> Result<JobHandle, StartError> {
    config.validate()?;
    crate::platform::check_memlock()?;
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
    let cores = core_affinity::get_core_ids().unwrap_or_default();
    let pin = config.pinning == Pinning::Auto && cores.len() >= shards;
    let endpoints = crate::exchange::wire(graph.exchanges, shards, config.ring_capacity_bytes);
    let config = Arc::new(config);
    let roots: Arc<Vec<Root>> = Arc::new(graph.roots);
    let metrics = Registry::new();
    let cancel = Arc::new(AtomicBool::new(false));
    let running = Arc::new(AtomicUsize::new(shards));
    let epoch = Instant::now();
    let mut threads = Vec::with_capacity(shards);
    for (shard, exchanges) in endpoints.into_iter().enumerate() {
        let placement = if pin {
            Placement::Fixed(cores[shard].id)
        } else {
            Placement::Unbound
        };
        let (config2, roots, metrics, shard_cancel, running, sentinel, state_dir) = (
            config.clone(),
            roots.clone(),
            metrics.clone(),
            cancel.clone(),
            running.clone(),
            sentinel.clone(),
            state_dir.clone(),
        );
        let spawned = LocalExecutorBuilder::new(placement)
            .name(&format!("weir-shard-{shard}"))
            .io_memory(config.io_memory_bytes)
            .spawn(move || async move {
                let _guard = CancelOnPanic(shard_cancel.clone());
                let cancel = &shard_cancel;
                let r = async {
                    crate::platform::dma_probe(&sentinel, shard).await?;
                    let state = crate::keyed::ShardState::new(&state_dir, shard, &config2)
                        .map_err(JobError::Start)?;
                    let mut ctx = BuildCtx {
                        shard,
                        shards: config2.shards,
                        config: config2.clone(),
                        heads: Vec::new(),
                        gate: Default::default(),
                        exchanges,
                        metrics,
                        fail: FailCell::default(),
                        state,
                        epoch,
                    };
                    for root in roots.iter() {
                        root(&mut ctx)?;
                        ctx.gate = std::rc::Rc::new(Gate::default());
                    }
                    run_loop(ctx, cancel).await
                }
                .await;
                if r.is_err() {
                    cancel.store(true, Ordering::Relaxed);
                }
                running.fetch_sub(1, Ordering::AcqRel);
                r
            });
        match spawned {
            Ok(t) => threads.push(t),
            Err(e) => {
                cancel.store(true, Ordering::Relaxed);
                for t in threads {
                    let _ = t.join();
                }
                return Err(StartError::Executor {
                    shard,
                    reason: e.to_string(),
                });
            }
        }
    }
    Ok(JobHandle {
        threads,
        cancel,
        running,
        metrics,
        shards,
        _state_dir: tmp,
    })
}

/// Wall-clock milliseconds: processing time.
pub(crate) fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

async fn run_loop(mut ctx: BuildCtx, cancel: &AtomicBool) -> Result<(), JobError> {
    let mut heads = std::mem::take(&mut ctx.heads);
    let mut done = vec![false; heads.len()];
    let mut idle_rounds = 0u32;
    let mut sleep = Duration::from_micros(10);
    loop {
        if cancel.load(Ordering::Relaxed) {
            return Err(JobError::Cancelled);
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
                            message: panic_message(&*p),
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
        if let Some(e) = ctx.state.maintain()? {
            return Err(e);
        }
        if live == 0 {
            return Ok(());
        }
        if progress {
            idle_rounds = 0;
            sleep = Duration::from_micros(10);
            glommio::yield_if_needed().await;
        } else {
            idle_rounds += 1;
            if idle_rounds < IDLE_SPIN_ROUNDS {
                std::hint::spin_loop();
                glommio::executor().yield_now().await;
            } else {
                glommio::timer::sleep(sleep).await;
                sleep = (sleep * 2).min(IDLE_SLEEP_MAX);
            }
        }
    }
}
