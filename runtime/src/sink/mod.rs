//! Sinks: where records leave a job.
//!
//! A [`Sink`] is a description shared by every shard; each shard asks it for a [`SinkWriter`].
//! The sink operator also records the age of latency markers into the job's latency histogram.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use hdrhistogram::Histogram;

use std::cell::RefCell;
use std::rc::Rc;

use crate::checkpoint::shard::{CompletionListener, ShardCheckpointRef};
use crate::checkpoint::snapshot::{Part, PartKind};
use crate::error::{JobError, StartError};
use crate::graph::{BuildCtx, FailCell};
use crate::metrics::{bump, new_latency_histogram, OperatorCounters, Registry};
use crate::operator::{Collector, Event};

mod file;
mod transactional;

pub use file::FileSinkWriter;
pub use transactional::{TransactionalFileSink, TransactionalFileWriter, SINK_LOCK_FILE};

/// One shard's writer of a sink.
///
/// With checkpointing, a writer takes part in two-phase commit: at checkpoint `n`'s barrier
/// [`SinkWriter::pre_commit`] makes everything written so far durable but not yet visible and
/// returns a description of it, which the checkpoint stores; when checkpoint `n` is complete
/// [`SinkWriter::commit`] makes it visible; after a failure, [`SinkWriter::restore`] gets the
/// description stored in the checkpoint the job restarts from, publishes it (idempotently) and
/// discards anything written after it. The defaults suit sinks without transactions.
pub trait SinkWriter<T>: 'static {
    /// Takes one record (and its event timestamp, or `i64::MIN`).
    fn write(&mut self, rec: T, ts: i64) -> std::io::Result<()>;
    /// The input ended: make everything written durable or visible.
    fn finish(&mut self) -> std::io::Result<()>;
    /// Barrier of checkpoint `checkpoint_id`: prepare what was written since the last
    /// pre-commit and describe it. Nothing may become visible yet.
    fn pre_commit(&mut self, checkpoint_id: u64) -> std::io::Result<Vec<u8>> {
        let _ = checkpoint_id;
        Ok(Vec::new())
    }
    /// Checkpoint `checkpoint_id` is complete: publish what its pre-commit (and every earlier
    /// one not yet published) prepared.
    fn commit(&mut self, checkpoint_id: u64) -> std::io::Result<()> {
        let _ = checkpoint_id;
        Ok(())
    }
    /// The job restarts from checkpoint `checkpoint_id`, whose pre-commit returned `state`:
    /// publish what it describes if not yet published, and discard anything prepared or
    /// written after it.
    fn restore(&mut self, checkpoint_id: u64, state: &[u8]) -> std::io::Result<()> {
        let _ = (checkpoint_id, state);
        Ok(())
    }
    /// Told before any [`restore`](Self::restore): whether the job accepts a restore that
    /// writes output committed since its checkpoint a second time
    /// ([`JobConfig::with_allow_fallback`](crate::JobConfig::with_allow_fallback): a fallback
    /// past a damaged checkpoint, or an older checkpoint or savepoint restored by path). A
    /// sink that can tell such a restore (the transactional file sink) refuses it otherwise.
    fn allow_rewind(&mut self, allowed: bool) {
        let _ = allowed;
    }
    /// Before any [`restore`](Self::restore), on every shard: the descriptions of every old
    /// shard (`states`, this sink's parts of checkpoint `checkpoint_id`), for checks that
    /// must refuse the restore on every shard before any shard changes anything (one shard
    /// refusing while another went on left its output half restored).
    fn check_restore(&mut self, checkpoint_id: u64, states: &[&[u8]]) -> std::io::Result<()> {
        let _ = (checkpoint_id, states);
        Ok(())
    }
}

/// A sink description, shared by every shard.
pub trait Sink<T>: Send + Sync + 'static {
    fn create_writer(
        &self,
        shard: usize,
        shards: usize,
    ) -> Result<Box<dyn SinkWriter<T>>, StartError>;
    fn name(&self) -> &str {
        "sink"
    }
}

/// The operator at the end of a chain: writes records, takes part in checkpoints (pre-commit
/// at the barrier, commit when the checkpoint completes) and records latency markers.
pub(crate) struct SinkOp<T> {
    name: String,
    shard: usize,
    writer: Rc<RefCell<Box<dyn SinkWriter<T>>>>,
    fail: FailCell,
    counters: Arc<OperatorCounters>,
    latency: Histogram<u64>,
    registry: Arc<Registry>,
    epoch: std::time::Instant,
    failed: bool,
    checkpoint: Option<ShardCheckpointRef>,
}

/// Commits a sink's pre-committed output when a checkpoint completes.
struct Committer<T> {
    writer: Rc<RefCell<Box<dyn SinkWriter<T>>>>,
    fail: FailCell,
    name: String,
    shard: usize,
}

impl<T: 'static> CompletionListener for Committer<T> {
    fn checkpoint_complete(&self, checkpoint_id: u64) {
        if let Err(source) = self.writer.borrow_mut().commit(checkpoint_id) {
            self.fail.fail(JobError::SinkIo {
                operator: self.name.clone(),
                shard: self.shard,
                source,
            });
        }
    }
}

impl<T: 'static> SinkOp<T> {
    pub fn new(
        name: String,
        mut writer: Box<dyn SinkWriter<T>>,
        ctx: &BuildCtx,
    ) -> Result<Self, StartError> {
        let io = |source: std::io::Error| StartError::Sink {
            operator: name.clone(),
            shard: ctx.shard,
            source,
        };
        if let Some(r) = &ctx.restore {
            writer.allow_rewind(ctx.config.allow_fallback);
            let all: Vec<&[u8]> = r
                .parts(&name, PartKind::Sink)
                .map(|(_, p)| p.bytes.as_slice())
                .collect();
            writer.check_restore(r.checkpoint_id, &all).map_err(io)?;
            let parts = r.parts_for_shard(&name, PartKind::Sink, ctx.shard);
            if parts.is_empty() {
                writer.restore(r.checkpoint_id, &[]).map_err(io)?;
            }
            for p in parts {
                writer.restore(r.checkpoint_id, &p.bytes).map_err(io)?;
            }
        }
        let writer = Rc::new(RefCell::new(writer));
        if let Some(c) = &ctx.checkpoint {
            let mut c = c.borrow_mut();
            c.register();
            c.listen(Rc::new(Committer {
                writer: writer.clone(),
                fail: ctx.fail.clone(),
                name: name.clone(),
                shard: ctx.shard,
            }));
        }
        Ok(Self {
            counters: ctx.metrics.operator(&name, ctx.shard),
            name,
            shard: ctx.shard,
            writer,
            fail: ctx.fail.clone(),
            latency: new_latency_histogram(),
            registry: ctx.metrics.clone(),
            epoch: ctx.epoch,
            failed: false,
            checkpoint: ctx.checkpoint.clone(),
        })
    }

    fn io_failed(&mut self, source: std::io::Error) {
        self.failed = true;
        self.fail.fail(JobError::SinkIo {
            operator: self.name.clone(),
            shard: self.shard,
            source,
        });
    }

    fn pre_commit(&mut self, id: u64) {
        let Some(c) = &self.checkpoint else { return };
        let t0 = std::time::Instant::now();
        match self.writer.borrow_mut().pre_commit(id) {
            Ok(bytes) => {
                let part = Part {
                    operator: self.name.clone(),
                    kind: PartKind::Sink,
                    bytes,
                    files: Vec::new(),
                    logical: Vec::new(),
                };
                c.borrow_mut()
                    .report(id, part, t0.elapsed().as_nanos() as u64);
            }
            // The checkpoint fails; the sink's data is still in its in-progress file and a
            // later checkpoint's pre-commit takes it.
            Err(e) => c
                .borrow_mut()
                .decline(id, format!("sink `{}` pre-commit: {e}", self.name)),
        }
    }
}

impl<T: 'static> Collector<T> for SinkOp<T> {
    #[inline]
    fn collect(&mut self, rec: T, ts: i64) {
        if self.failed {
            return;
        }
        bump(&self.counters.records_in, 1);
        let r = self.writer.borrow_mut().write(rec, ts);
        if let Err(e) = r {
            self.io_failed(e);
        }
    }

    fn event(&mut self, ev: Event) {
        match ev {
            Event::LatencyMarker { created_ns } => {
                let now = self.epoch.elapsed().as_nanos() as u64;
                let _ = self.latency.record(now.saturating_sub(created_ns).max(1));
                if self.latency.len() >= 64 {
                    self.registry.record_latency(&self.latency);
                    self.latency.reset();
                }
            }
            Event::EndOfInput => {
                self.registry.record_latency(&self.latency);
                self.latency.reset();
                if !self.failed {
                    let r = self.writer.borrow_mut().finish();
                    if let Err(e) = r {
                        self.io_failed(e);
                    }
                }
            }
            Event::Barrier(id) => self.pre_commit(id),
            Event::Watermark(_) | Event::Idle(_) => {}
        }
    }

    fn processing_time(&mut self, _now_ms: i64) {}
}

/// Collects records into memory. See [`Stream::collect`](crate::Stream::collect).
pub struct CollectSink<T> {
    out: Arc<Mutex<Vec<T>>>,
}

/// The records a [`CollectSink`] gathered. Shards hand over their records in chunks, and the
/// rest when their input ends or their writer goes (a stop with a savepoint, a cancel, a
/// failure), so a finished or stopped job's collection holds every record its sinks got.
#[derive(Clone)]
pub struct Collected<T> {
    out: Arc<Mutex<Vec<T>>>,
}

impl<T> Collected<T> {
    /// Takes the records gathered so far.
    pub fn take(&self) -> Vec<T> {
        std::mem::take(&mut *self.out.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// How many records are gathered.
    pub fn len(&self) -> usize {
        self.out.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl<T> CollectSink<T> {
    pub fn new() -> (Self, Collected<T>) {
        let out = Arc::new(Mutex::new(Vec::new()));
        (Self { out: out.clone() }, Collected { out })
    }
}

struct CollectWriter<T> {
    local: Vec<T>,
    out: Arc<Mutex<Vec<T>>>,
}

impl<T: Send + 'static> SinkWriter<T> for CollectWriter<T> {
    fn write(&mut self, rec: T, _ts: i64) -> std::io::Result<()> {
        self.local.push(rec);
        // Hand over in chunks so that readers see progress of long jobs.
        if self.local.len() >= 4096 {
            self.out
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .append(&mut self.local);
        }
        Ok(())
    }
    fn finish(&mut self) -> std::io::Result<()> {
        self.hand_over();
        Ok(())
    }
}

impl<T> CollectWriter<T> {
    fn hand_over(&mut self) {
        if !self.local.is_empty() {
            self.out
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .append(&mut self.local);
        }
    }
}

/// A writer that goes without `finish` (a job stopped with a savepoint ends its shards
/// without finishing its sinks) still hands over what it holds: up to a chunk a shard was
/// lost.
impl<T> Drop for CollectWriter<T> {
    fn drop(&mut self) {
        self.hand_over();
    }
}

impl<T: Send + 'static> Sink<T> for CollectSink<T> {
    fn create_writer(
        &self,
        _shard: usize,
        _shards: usize,
    ) -> Result<Box<dyn SinkWriter<T>>, StartError> {
        Ok(Box::new(CollectWriter {
            local: Vec::new(),
            out: self.out.clone(),
        }))
    }
    fn name(&self) -> &str {
        "collect"
    }
}

/// Calls a function for every record. See [`Stream::for_each`](crate::Stream::for_each).
pub struct CallbackSink<F> {
    f: Arc<F>,
}

impl<F> CallbackSink<F> {
    pub fn new(f: F) -> Self {
        Self { f: Arc::new(f) }
    }
}

struct CallbackWriter<F> {
    f: Arc<F>,
}

impl<T: 'static, F: Fn(T) + Send + Sync + 'static> SinkWriter<T> for CallbackWriter<F> {
    #[inline]
    fn write(&mut self, rec: T, _ts: i64) -> std::io::Result<()> {
        (self.f)(rec);
        Ok(())
    }
    fn finish(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<T: 'static, F: Fn(T) + Send + Sync + 'static> Sink<T> for CallbackSink<F> {
    fn create_writer(
        &self,
        _shard: usize,
        _shards: usize,
    ) -> Result<Box<dyn SinkWriter<T>>, StartError> {
        Ok(Box::new(CallbackWriter { f: self.f.clone() }))
    }
    fn name(&self) -> &str {
        "callback"
    }
}

/// Writes one text line per record into `dir/part-<shard>.csv` (not transactional).
pub struct FileSink<F> {
    dir: PathBuf,
    format: Arc<F>,
}

impl<F> FileSink<F> {
    pub fn new(dir: impl Into<PathBuf>, format: F) -> Self {
        Self {
            dir: dir.into(),
            format: Arc::new(format),
        }
    }
}

struct FileWriter<F> {
    w: FileSinkWriter,
    format: Arc<F>,
    line: String,
}

impl<T: 'static, F: Fn(&T, &mut String) + Send + Sync + 'static> SinkWriter<T> for FileWriter<F> {
    fn write(&mut self, rec: T, _ts: i64) -> std::io::Result<()> {
        self.line.clear();
        (self.format)(&rec, &mut self.line);
        self.w.write_line(&self.line)
    }
    fn finish(&mut self) -> std::io::Result<()> {
        self.w.finish()
    }
}

impl<T: 'static, F: Fn(&T, &mut String) + Send + Sync + 'static> Sink<T> for FileSink<F> {
    fn create_writer(
        &self,
        shard: usize,
        _shards: usize,
    ) -> Result<Box<dyn SinkWriter<T>>, StartError> {
        let w = FileSinkWriter::create(&self.dir, shard).map_err(|source| StartError::Sink {
            operator: "file".into(),
            shard,
            source,
        })?;
        Ok(Box::new(FileWriter {
            w,
            format: self.format.clone(),
            line: String::new(),
        }))
    }
    fn name(&self) -> &str {
        "file"
    }
}
