//! The stream API: a job builder and typed streams, close to Flink's DataStream.

use std::cell::RefCell;
use std::marker::PhantomData;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use crate::checkpoint::shard::ShardCheckpointRef;
use crate::checkpoint::snapshot::{Part, PartKind};
use crate::config::JobConfig;
use crate::data::Data;
use crate::error::{JobError, StartError};
use crate::graph::{name_of, BuildCtx, Factory, Graph, GraphRef, Head, HeadStatus, Name};
use crate::metrics::{bump, HeadCounters};
use crate::operator::{Counted, Emit, Event, FlatMapOp, InputMerger, Out, UnionInput, NO_TS};
use crate::sink::{CallbackSink, CollectSink, Collected, FileSink, Sink, SinkOp};
use crate::source::{IterSource, Source, SourcePoll, SourceReader};

/// A job under construction. Add sources, transform the streams, end them in sinks, then
/// [`Job::start`] or [`Job::run`].
pub struct Job {
    pub(crate) graph: GraphRef,
    pub(crate) config: JobConfig,
    pub(crate) errors: Rc<RefCell<Vec<String>>>,
}

impl Job {
    pub fn new(config: JobConfig) -> Self {
        Self {
            graph: Rc::new(RefCell::new(Graph::default())),
            config,
            errors: Rc::default(),
        }
    }

    pub fn config(&self) -> &JobConfig {
        &self.config
    }

    /// A stream read from `source`, split over shards as the source decides.
    pub fn source<T: Data>(&self, source: impl Source<T>) -> Stream<T> {
        let name = self.graph.borrow_mut().name(source.name());
        let source = Arc::new(source);
        let slot = name.clone();
        let factory: Factory<T> = Arc::new(move |ctx: &mut BuildCtx, down: Out<T>| {
            let name2 = name_of(&slot);
            let mut reader =
                source
                    .create_reader(ctx.shard, ctx.shards)
                    .map_err(|e| StartError::Source {
                        operator: name2.clone(),
                        source: e,
                    })?;
            if ctx.checkpoint.is_some() {
                reader.enable_checkpointing();
            }
            if let Some(r) = &ctx.restore {
                // Every old reader's position, and those this shard takes over (old shard `s`
                // goes to `s % shards`). A checkpoint without any (a source the old job did
                // not have, or whose readers had nothing to record) leaves the reader as made.
                let all: Vec<(usize, &[u8])> = r
                    .parts(&name2, PartKind::Source)
                    .map(|(s, p)| (s, p.bytes.as_slice()))
                    .filter(|(_, b)| !b.is_empty())
                    .collect();
                if !all.is_empty() {
                    let mine: Vec<(usize, &[u8])> = all
                        .into_iter()
                        .filter(|(s, _)| s % ctx.shards == ctx.shard)
                        .collect();
                    reader
                        .restore(r.shards.len(), &mine)
                        .map_err(|e| StartError::Restore {
                            reason: format!(
                                "checkpoint {} (taken on {} shards), source `{name2}` on shard \
                                 {} of {}: {e}",
                                r.checkpoint_id,
                                r.shards.len(),
                                ctx.shard,
                                ctx.shards
                            ),
                        })?;
                }
            }
            reader.start().map_err(|e| StartError::Source {
                operator: name2.clone(),
                source: e,
            })?;
            // The timestamp assigners of this chain learn the reader's splits before any
            // record: those it tells, or one (`0`) for a reader that does not.
            let subscribers = std::mem::take(&mut ctx.split_tags);
            let split_tags = (!subscribers.is_empty()).then(|| {
                let (mut runs, mut live) = (Vec::new(), Vec::new());
                let tells = reader.splits(&mut runs, &mut live);
                if !tells {
                    live.push(0);
                }
                let subscribers: Vec<_> = subscribers
                    .into_iter()
                    .map(|tags| {
                        let source = tags.register(&name2);
                        tags.publish(source, &live, &[]);
                        (tags, source)
                    })
                    .collect();
                SplitRuns {
                    subscribers,
                    tells,
                    runs,
                    live,
                }
            });
            let reader = Rc::new(RefCell::new(reader));
            if let Some(c) = &ctx.checkpoint {
                let mut c = c.borrow_mut();
                c.register();
                c.shared
                    .sources_total
                    .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
                c.listen(Rc::new(SourceCompletion {
                    reader: reader.clone(),
                }));
            }
            let counters = ctx.metrics.operator(&name2, ctx.shard);
            let head = SourceHead {
                name: name2.clone(),
                shard: ctx.shard,
                reader,
                buf: Vec::with_capacity(ctx.config.batch_records),
                batch: ctx.config.batch_records,
                down: Box::new(Counted { counters, down }),
                split_tags,
                gate: ctx.take_gate(),
                state: SourceState::Running,
                last_ms: i64::MIN,
                marker_interval_ms: ctx.config.latency_marker_interval_ms as i64,
                next_marker_ms: i64::MIN,
                epoch: ctx.epoch,
                counters: ctx.metrics.head(&name2, ctx.shard),
                // Barriers requested before this attempt started belong to an earlier attempt.
                last_barrier: ctx.checkpoint.as_ref().map_or(0, |c| {
                    c.borrow()
                        .shared
                        .requested
                        .load(std::sync::atomic::Ordering::Acquire)
                }),
                checkpoint: ctx.checkpoint.clone(),
                stop: ctx.stop.clone(),
            };
            ctx.heads.push(Box::new(head));
            Ok(())
        });
        self.stream(factory, name)
    }

    /// A stream of the items that `make` yields on each shard. `make(shard, shards)` is called
    /// once per shard; return an empty iterator on shards that should not produce.
    pub fn from_iter<T, I, F>(&self, make: F) -> Stream<T>
    where
        T: Data,
        I: Iterator<Item = T> + 'static,
        F: Fn(usize, usize) -> I + Send + Sync + 'static,
    {
        self.source(IterSource::new(make))
    }

    /// A stream of the items of `items`, all read on shard 0, in order.
    pub fn from_vec<T: Data + Sync>(&self, items: Vec<T>) -> Stream<T> {
        let items = Arc::new(items);
        self.from_iter(move |shard, _| {
            let items = items.clone();
            let n = if shard == 0 { items.len() } else { 0 };
            (0..n).map(move |i| items[i].clone())
        })
    }

    pub(crate) fn stream<T>(&self, factory: Factory<T>, name: Name) -> Stream<T> {
        Stream {
            graph: self.graph.clone(),
            errors: self.errors.clone(),
            factory,
            name,
        }
    }

    /// Starts the job on its shards and returns at once.
    pub fn start(self) -> Result<crate::JobHandle, StartError> {
        if let Some(e) = self.errors.borrow().first() {
            return Err(StartError::Config {
                key: "graph".into(),
                reason: e.clone(),
            });
        }
        let graph = std::mem::take(&mut *self.graph.borrow_mut());
        crate::shard::start(self.config, graph)
    }

    /// Starts the job and waits until it finishes.
    pub fn run(self) -> Result<crate::JobSummary, JobError> {
        self.start()?.wait()
    }
}

/// A stream of records of type `T`.
pub struct Stream<T> {
    pub(crate) graph: GraphRef,
    pub(crate) errors: Rc<RefCell<Vec<String>>>,
    pub(crate) factory: Factory<T>,
    /// The name of the operator that produces this stream (its uid once set).
    pub(crate) name: Name,
}

impl<T: Data> Stream<T> {
    pub(crate) fn derive<U>(&self, factory: Factory<U>, name: Name) -> Stream<U> {
        Stream {
            graph: self.graph.clone(),
            errors: self.errors.clone(),
            factory,
            name,
        }
    }

    pub(crate) fn new_name(&self, kind: &str) -> Name {
        self.graph.borrow_mut().name(kind)
    }

    /// The name of the operator that produces this stream, as metrics show it.
    pub fn name(&self) -> String {
        name_of(&self.name)
    }

    fn chain<U: 'static, F>(self, kind: &str, f: F) -> Stream<U>
    where
        F: Fn(T, &mut Emit<'_, U>) + Send + Sync + 'static,
    {
        let name = self.new_name(kind);
        let up = self.factory.clone();
        let f = Arc::new(f);
        let slot = name.clone();
        let factory: Factory<U> = Arc::new(move |ctx: &mut BuildCtx, down: Out<U>| {
            let f = f.clone();
            let op = FlatMapOp {
                f: move |t: T, e: &mut Emit<'_, U>| f(t, e),
                counters: ctx.metrics.operator(&name_of(&slot), ctx.shard),
                down,
                _t: PhantomData,
            };
            up(ctx, Box::new(op))
        });
        Stream {
            graph: self.graph,
            errors: self.errors,
            factory,
            name,
        }
    }

    /// Applies `f` to every record.
    pub fn map<U: Data>(self, f: impl Fn(T) -> U + Send + Sync + 'static) -> Stream<U> {
        self.chain("map", move |t, e| e.emit(f(t)))
    }

    /// Keeps the records for which `f` is true.
    pub fn filter(self, f: impl Fn(&T) -> bool + Send + Sync + 'static) -> Stream<T> {
        self.chain("filter", move |t, e| {
            if f(&t) {
                e.emit(t)
            }
        })
    }

    /// Emits every item that `f` returns for a record.
    pub fn flat_map<U: Data, I: IntoIterator<Item = U>>(
        self,
        f: impl Fn(T) -> I + Send + Sync + 'static,
    ) -> Stream<U> {
        self.chain("flat_map", move |t, e| {
            for u in f(t) {
                e.emit(u)
            }
        })
    }

    /// Maps and filters in one step.
    pub fn filter_map<U: Data>(
        self,
        f: impl Fn(T) -> Option<U> + Send + Sync + 'static,
    ) -> Stream<U> {
        self.chain("filter_map", move |t, e| {
            if let Some(u) = f(t) {
                e.emit(u)
            }
        })
    }

    /// Calls `f` on every record and passes it on unchanged.
    pub fn inspect(self, f: impl Fn(&T) + Send + Sync + 'static) -> Stream<T> {
        self.chain("inspect", move |t, e| {
            f(&t);
            e.emit(t)
        })
    }

    /// Gives the operator that produces this stream a stable uid: it names the operator's state
    /// in checkpoints and its metrics. Every stateful operator should have one.
    pub fn uid(self, uid: &str) -> Self {
        let r = self.graph.borrow_mut().uid(uid);
        match r {
            Ok(u) => *self.name.lock().unwrap_or_else(|p| p.into_inner()) = u,
            Err(e) => self.errors.borrow_mut().push(e),
        }
        self
    }

    /// Merges two streams of the same type.
    pub fn union(self, other: impl Into<Stream<T>>) -> Stream<T> {
        let other: Stream<T> = other.into();
        let name = self.new_name("union");
        let a = self.factory.clone();
        let b = other.factory.clone();
        let factory: Factory<T> = Arc::new(move |ctx: &mut BuildCtx, down: Out<T>| {
            let mut m = InputMerger::new(2);
            m.align = crate::checkpoint::aligns(ctx);
            // Each input's head is held back by its own flag while the union aligns a barrier.
            let gate = ctx.gate.clone();
            let g0 = crate::graph::Gate::child_of(gate.clone());
            g0.add_blocker(m.blocked[0].clone());
            let g1 = crate::graph::Gate::child_of(gate);
            g1.add_blocker(m.blocked[1].clone());
            let merger = Rc::new(RefCell::new(m));
            let down = Rc::new(RefCell::new(down));
            // A timestamp assigner after the union tracks the splits of the sources of both
            // inputs (its tags go to the heads of each); one in an input, those of its own.
            let split_tags = ctx.split_tags.clone();
            ctx.gate = Rc::new(g0);
            a(
                ctx,
                Box::new(UnionInput {
                    index: 0,
                    merger: merger.clone(),
                    down: down.clone(),
                }),
            )?;
            ctx.gate = Rc::new(g1);
            ctx.split_tags = split_tags;
            b(
                ctx,
                Box::new(UnionInput {
                    index: 1,
                    merger,
                    down,
                }),
            )
        });
        self.derive(factory, name)
    }

    /// Sends records to every shard round-robin.
    pub fn rebalance(self) -> Stream<T> {
        crate::exchange::exchange(self, "rebalance", crate::exchange::Route::RoundRobin)
    }

    /// Sends every record to every shard.
    pub fn broadcast(self) -> Stream<T> {
        crate::exchange::exchange(self, "broadcast", crate::exchange::Route::Broadcast)
    }

    /// Partitions the stream by key: records with equal keys meet on one shard, in order.
    pub fn key_by<K, F>(self, key: F) -> crate::keyed::KeyedStream<T, K>
    where
        K: crate::keyed::Key,
        F: Fn(&T) -> K + Send + Sync + 'static,
    {
        crate::keyed::KeyedStream::new(self, Arc::new(key))
    }

    /// Assigns event timestamps and generates watermarks.
    pub fn assign_timestamps(self, strategy: crate::time::WatermarkStrategy<T>) -> Stream<T> {
        crate::time::assign(self, strategy)
    }

    /// Ends the stream in `sink`. Give a sink that keeps state in checkpoints (the
    /// exactly-once file sink's transactions) a stable uid with [`StreamSink::uid`].
    pub fn sink(self, sink: impl Sink<T>) -> StreamSink {
        let name = self.new_name(sink.name());
        let sink = Arc::new(sink);
        let up = self.factory.clone();
        let built = name.clone();
        self.graph
            .borrow_mut()
            .roots
            .push(Arc::new(move |ctx: &mut BuildCtx| {
                let writer = sink.create_writer(ctx.shard, ctx.shards)?;
                let op = SinkOp::new(name_of(&built), writer, ctx)?;
                up(ctx, Box::new(op))
            }));
        StreamSink {
            graph: self.graph,
            name,
            errors: self.errors,
        }
    }

    /// Collects every record; read them from the returned handle after the job finished.
    pub fn collect(self) -> Collected<T> {
        let (sink, collected) = CollectSink::new();
        self.sink(sink);
        collected
    }

    /// Calls `f` for every record, on the shard that holds it.
    pub fn for_each(self, f: impl Fn(T) + Send + Sync + 'static) {
        self.sink(CallbackSink::new(f));
    }

    /// Writes one line per record into `dir/part-<shard>.csv`; `format` renders a record.
    pub fn write_lines(
        self,
        dir: impl Into<std::path::PathBuf>,
        format: impl Fn(&T, &mut String) + Send + Sync + 'static,
    ) -> StreamSink {
        self.sink(FileSink::new(dir, format))
    }
}

/// The sink a stream ends in (Flink's `DataStreamSink`): where it gets its uid.
pub struct StreamSink {
    graph: GraphRef,
    name: Name,
    errors: Rc<RefCell<Vec<String>>>,
}

impl StreamSink {
    /// Gives the sink a stable uid: it names the sink's state in checkpoints (a restore
    /// hands that state to the sink with the same uid) and its metrics. Without one the
    /// name is generated from the sink's kind and its place in the job, which changes when
    /// the job does.
    pub fn uid(self, uid: &str) -> Self {
        match self.graph.borrow_mut().uid(uid) {
            Ok(u) => *self.name.lock().unwrap_or_else(|p| p.into_inner()) = u,
            Err(e) => self.errors.borrow_mut().push(e),
        }
        self
    }
}

enum SourceState {
    Running,
    /// The reader finished and the final watermark went out; with checkpointing, the stream
    /// stays open until the checkpoint taken after every source finished is complete, so that
    /// it commits the job's last output.
    Finished,
    /// The end-of-input events are sent, waiting for the gate to drain.
    Ending,
}

/// Tells a source's reader of completed checkpoints (an ingress then lets go of what it
/// kept for a replay).
struct SourceCompletion<T> {
    reader: Rc<RefCell<Box<dyn SourceReader<T>>>>,
}

impl<T: 'static> crate::checkpoint::shard::CompletionListener for SourceCompletion<T> {
    fn checkpoint_complete(&self, checkpoint_id: u64) {
        // Called between head steps, when nothing borrows the reader; were it borrowed, the
        // next completion (which covers this one) would tell it.
        if let Ok(mut r) = self.reader.try_borrow_mut() {
            r.notify_checkpoint_complete(checkpoint_id);
        }
    }
}

/// What a source head tells the timestamp assigners of its chain of its reader's splits,
/// with the buffers it asks the reader for them in.
struct SplitRuns {
    /// Each assigner's tags, with the number this source has there.
    subscribers: Vec<(Rc<crate::time::SplitTags>, u32)>,
    /// Whether the reader tells its splits; one that does not reads one, split `0`.
    tells: bool,
    runs: Vec<(u64, usize)>,
    live: Vec<u64>,
}

/// Drives a source reader into its chain.
struct SourceHead<T> {
    name: String,
    shard: usize,
    /// Shared with its [`SourceCompletion`].
    reader: Rc<RefCell<Box<dyn SourceReader<T>>>>,
    buf: Vec<T>,
    batch: usize,
    down: Out<T>,
    /// Set when a timestamp assigner in the chain tracks the reader's splits.
    split_tags: Option<SplitRuns>,
    gate: Rc<crate::graph::Gate>,
    state: SourceState,
    last_ms: i64,
    marker_interval_ms: i64,
    next_marker_ms: i64,
    epoch: std::time::Instant,
    counters: Arc<HeadCounters>,
    checkpoint: Option<ShardCheckpointRef>,
    last_barrier: u64,
    /// See `BuildCtx::stop`: read before each record of a poll.
    stop: Arc<AtomicBool>,
}

impl<T: 'static> SourceHead<T> {
    /// Injects the newest requested barrier: records the reader's position (everything before
    /// the barrier was emitted) and sends the barrier down the chain.
    fn inject_barrier(&mut self) {
        let Some(c) = &self.checkpoint else { return };
        let requested = c
            .borrow()
            .shared
            .requested
            .load(std::sync::atomic::Ordering::Acquire);
        if requested <= self.last_barrier {
            return;
        }
        let t0 = std::time::Instant::now();
        self.last_barrier = requested;
        let part = Part {
            operator: self.name.clone(),
            kind: PartKind::Source,
            bytes: self.reader.borrow_mut().snapshot_position(requested),
            files: Vec::new(),
            logical: Vec::new(),
        };
        c.borrow_mut()
            .report(requested, part, t0.elapsed().as_nanos() as u64);
        self.down.event(Event::Barrier(requested));
    }

    /// Whether the newest barrier this source injected is a stop-with-savepoint's that still
    /// stands: it then reads nothing more (see `Shared::stop_at`); withdrawn (the savepoint
    /// failed), it reads on.
    fn stopped_at_barrier(&self) -> bool {
        self.checkpoint.as_ref().is_some_and(|c| {
            let at = c
                .borrow()
                .shared
                .stop_at
                .load(std::sync::atomic::Ordering::Acquire);
            at != 0 && at == self.last_barrier
        })
    }
}

impl<T: 'static> Head for SourceHead<T> {
    fn name(&self) -> &str {
        &self.name
    }

    fn step(&mut self, now_ms: i64) -> Result<HeadStatus, JobError> {
        let t0 = std::time::Instant::now();
        // A barrier goes out even under backpressure: it queues behind the records before it.
        self.inject_barrier();
        if !self.gate.flush() || self.gate.is_blocked() {
            bump(
                &self.counters.backpressured_ns,
                t0.elapsed().as_nanos() as u64,
            );
            return Ok(HeadStatus::Blocked);
        }
        match self.state {
            SourceState::Ending => return Ok(HeadStatus::Done),
            SourceState::Finished => {
                let done = self
                    .checkpoint
                    .as_ref()
                    .is_none_or(|c| c.borrow().shared.final_complete());
                if !done {
                    return Ok(HeadStatus::Idle);
                }
                self.down.event(Event::EndOfInput);
                self.state = SourceState::Ending;
                self.gate.flush();
                return Ok(HeadStatus::Progress);
            }
            SourceState::Running => {}
        }
        if self.stopped_at_barrier() {
            return Ok(HeadStatus::Idle);
        }
        if now_ms != self.last_ms {
            self.last_ms = now_ms;
            self.down.processing_time(now_ms);
            if self.marker_interval_ms > 0 && now_ms >= self.next_marker_ms {
                self.next_marker_ms = now_ms + self.marker_interval_ms;
                let created_ns = self.epoch.elapsed().as_nanos() as u64;
                self.down.event(Event::LatencyMarker { created_ns });
            }
        }
        self.buf.clear();
        let poll = self
            .reader
            .borrow_mut()
            .poll(&mut self.buf, self.batch)
            .map_err(|source| JobError::Source {
                operator: self.name.clone(),
                shard: self.shard,
                source,
            })?;
        let n = self.buf.len();
        match &mut self.split_tags {
            None => {
                for rec in self.buf.drain(..) {
                    if self.stop.load(Ordering::Relaxed) {
                        return Err(JobError::Cancelled);
                    }
                    self.down.collect(rec, NO_TS);
                }
            }
            Some(s) => {
                s.runs.clear();
                s.live.clear();
                if s.tells {
                    self.reader.borrow().splits(&mut s.runs, &mut s.live);
                } else {
                    if n > 0 {
                        s.runs.push((0, n));
                    }
                    if poll != SourcePoll::Finished {
                        s.live.push(0);
                    }
                }
                // The splits of this poll's records count before them, those it finished
                // too (until their records are in); then only those not finished.
                for (tags, source) in &s.subscribers {
                    tags.publish(*source, &s.live, &s.runs);
                }
                let mut recs = self.buf.drain(..);
                for &(split, count) in &s.runs {
                    for (tags, source) in &s.subscribers {
                        tags.set_current(*source, split);
                    }
                    for rec in recs.by_ref().take(count) {
                        if self.stop.load(Ordering::Relaxed) {
                            return Err(JobError::Cancelled);
                        }
                        self.down.collect(rec, NO_TS);
                    }
                }
                // Records the runs did not count (a reader's mistake) go as the last split's.
                for rec in recs {
                    self.down.collect(rec, NO_TS);
                }
                for (tags, source) in &s.subscribers {
                    tags.publish(*source, &s.live, &[]);
                }
            }
        }
        let status = match poll {
            SourcePoll::Finished => {
                self.down.event(Event::Watermark(i64::MAX));
                self.state = SourceState::Finished;
                if let Some(c) = &self.checkpoint {
                    c.borrow()
                        .shared
                        .sources_finished
                        .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
                }
                HeadStatus::Progress
            }
            _ if n > 0 => HeadStatus::Progress,
            _ => HeadStatus::Idle,
        };
        self.gate.flush();
        let spent = t0.elapsed().as_nanos() as u64;
        match status {
            HeadStatus::Idle => bump(&self.counters.idle_ns, spent),
            _ => bump(&self.counters.busy_ns, spent),
        }
        Ok(status)
    }
}
