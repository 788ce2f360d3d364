//! Keyed streams and keyed operators: reduce, aggregate, process functions with timers, and the
//! two-input keyed connect.
//!
//! A key is encoded with [`weir_state::KeyCodec`] into stable bytes; its key group is a stable
//! hash of those bytes modulo the max parallelism, and each shard owns a contiguous range of key
//! groups. Keyed state lives in the shard's state store ([`ShardState`]), addressed by the
//! operator's uid, the state's name, the key group, the key and a namespace (a window).

use std::collections::BTreeMap;
use std::marker::PhantomData;
use std::sync::Arc;

use weir_state::KeyCodec;

use crate::data::Data;
use crate::exchange::{exchange, Route};
use crate::graph::{name_of, BuildCtx, Factory, FailCell};
use crate::metrics::{bump, OperatorCounters};
use crate::operator::{Collector, Event, Out, NO_TS};
use crate::stream::Stream;

pub use crate::backend::{ShardState, StateId};

/// The shard that owns `key_group` when `max_parallelism` key groups are split into `shards`
/// contiguous ranges (as Flink's KeyGroupRangeAssignment does).
#[inline]
pub fn shard_for_key_group(key_group: u16, max_parallelism: u16, shards: usize) -> usize {
    usize::from(key_group) * shards / usize::from(max_parallelism)
}

/// The key group of an encoded key.
#[inline]
pub fn key_group_of(key_bytes: &[u8], max_parallelism: u16) -> u16 {
    weir_state::key_group_for(key_bytes, max_parallelism)
}

/// What a key must be: a stable, order-preserving encoding that decodes back to the key
/// (timers restored from a checkpoint hand the key to `on_timer`). Implemented for integers,
/// bool, String, byte vectors and tuples of them.
pub trait Key: KeyCodec<Owned = Self> + Clone + Send + Sync + 'static {}

impl<K: KeyCodec<Owned = K> + Clone + Send + Sync + 'static> Key for K {}

/// A key selector shared by the shards.
pub(crate) type KeyFn<T, K> = Arc<dyn Fn(&T) -> K + Send + Sync>;

/// Routes records by the key group of their key.
pub(crate) fn key_route<T: 'static, K: KeyCodec + 'static>(key: KeyFn<T, K>) -> Route<T> {
    Route::KeyGroup(Arc::new(
        move |t: &T, max_parallelism: u16, scratch: &mut Vec<u8>| {
            scratch.clear();
            key(t).encode_key(scratch);
            key_group_of(scratch, max_parallelism)
        },
    ))
}

/// A stream partitioned by key.
pub struct KeyedStream<T, K> {
    pub(crate) up: Stream<T>,
    pub(crate) key: KeyFn<T, K>,
}

impl<T: Data, K: Key> KeyedStream<T, K> {
    pub(crate) fn new(up: Stream<T>, key: KeyFn<T, K>) -> Self {
        Self { up, key }
    }

    /// A running reduce per key: for every record, emits the reduction of the key's records so
    /// far (Flink's `KeyedStream.reduce`).
    pub fn reduce(self, f: impl Fn(T, T) -> T + Send + Sync + 'static) -> Stream<T> {
        let f = Arc::new(f);
        self.process(FnProcess::new(
            move |rec: T, ctx: &mut KeyedContext<'_, K, T>| {
                if let Some(next) = ctx.reducing_add("reduce", rec, |a, b| f(a, b)) {
                    ctx.emit(next);
                }
            },
        ))
        .with_kind("reduce")
    }

    /// A running aggregate per key: for every record, emits `agg.result` of the key's
    /// accumulator after adding the record.
    pub fn aggregate<A: Data, O: Data>(self, agg: impl AggregateFunction<T, A, O>) -> Stream<O> {
        let agg = Arc::new(agg);
        self.process(FnProcess::new(
            move |rec: T, ctx: &mut KeyedContext<'_, K, O>| {
                if let Some(out) = ctx.aggregating_add("aggregate", &*agg, rec) {
                    ctx.emit(out);
                }
            },
        ))
        .with_kind("aggregate")
    }

    /// Applies a keyed process function: per-record logic with keyed state and timers.
    pub fn process<O: Data, P: KeyedProcessFunction<K, T, O>>(self, f: P) -> ProcessStream<O> {
        let graph = self.up.graph.clone();
        let errors = self.up.errors.clone();
        let name = self.up.new_name("process");
        let slot = name.clone();
        let f = Arc::new(f);
        let ttls = StateTtls::default();
        let op_ttls = ttls.clone();
        // The exchange is built lazily at shard build time from the config's max parallelism.
        let up = self.up;
        let key = self.key;
        let exchanged = exchange(up, "key_by", key_route(key.clone()));
        let upf = exchanged.factory.clone();
        let factory: Factory<O> = Arc::new(move |ctx: &mut BuildCtx, down: Out<O>| {
            let name = name_of(&slot);
            let mut ops = OpState::new::<K>(&name, ctx)?;
            for (state, ttl_ms) in op_ttls.lock().unwrap_or_else(|p| p.into_inner()).iter() {
                ops.set_ttl(state, *ttl_ms)?;
            }
            let op = KeyedOp {
                f: f.clone(),
                key: key.clone(),
                timers: TimerQueues::restored(&ops.state, &name, ctx.shard)?,
                ops,
                counters: ctx.metrics.operator(&name, ctx.shard),
                down,
                ahead: Lookahead::default(),
                _p: PhantomData,
            };
            upf(ctx, Box::new(op))
        });
        ProcessStream {
            stream: Stream {
                graph,
                errors,
                factory,
                name,
            },
            ttls,
        }
    }

    /// Groups records into windows per key (event time).
    pub fn window(
        self,
        assigner: crate::window::WindowAssigner,
    ) -> crate::window::WindowedStream<T, K> {
        crate::window::WindowedStream::new(self, assigner)
    }

    /// Connects with another keyed stream of the same key type, for joins: a two-input keyed
    /// process function sees both inputs' records of one key, with shared keyed state.
    pub fn connect<U: Data>(
        self,
        other: KeyedStream<U, K>,
    ) -> crate::join::ConnectedStreams<T, U, K> {
        crate::join::ConnectedStreams::new(self, other)
    }
}

/// The TTLs a keyed operator's states were given ([`ProcessStream::state_ttl`]), by state
/// name, in milliseconds; read when the operator is built on each shard.
type StateTtls = Arc<std::sync::Mutex<Vec<(String, u64)>>>;

/// A stream produced by a keyed operator; derefs to [`Stream`].
pub struct ProcessStream<O> {
    pub(crate) stream: Stream<O>,
    ttls: StateTtls,
}

impl<O: Data> ProcessStream<O> {
    fn with_kind(self, kind: &str) -> Stream<O> {
        // Default names say what the operator is; a user `uid` replaces them.
        let mut n = self.stream.name.lock().unwrap_or_else(|p| p.into_inner());
        *n = n.replacen("process", kind, 1);
        drop(n);
        self.stream
    }

    /// Gives the operator's state `state` a time to live, as Flink's `StateTtlConfig` does
    /// with its defaults: an entry (a value; each element of a list; each entry of a map)
    /// expires `ttl` of processing time (whole milliseconds, rounded down) after it was last
    /// written, reads never return it once expired, and compaction drops it. The expiry is
    /// written with the entry, so it holds across checkpoints and restores: a TTL added,
    /// changed or removed for a restored job applies to entries from their next write, while
    /// the entries restored keep the expiry they were written with (Flink refuses such a
    /// restore instead). A TTL under one millisecond stops the job before start; a name the
    /// function never uses is not detected. Call it before [`Self::uid`], which returns the
    /// plain [`Stream`].
    pub fn state_ttl(self, state: &str, ttl: std::time::Duration) -> ProcessStream<O> {
        let ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX);
        if ms == 0 {
            self.stream.errors.borrow_mut().push(format!(
                "state `{state}`: a TTL must be at least 1 ms, got {ttl:?}"
            ));
        }
        let mut t = self.ttls.lock().unwrap_or_else(|p| p.into_inner());
        t.retain(|(n, _)| n != state);
        t.push((state.to_owned(), ms));
        drop(t);
        self
    }

    /// Gives the operator a stable uid (see [`Stream::uid`]).
    pub fn uid(self, uid: &str) -> Stream<O> {
        self.stream.uid(uid)
    }

    /// The stream itself.
    pub fn stream(self) -> Stream<O> {
        self.stream
    }

    // [`Stream`]'s operations, so that a keyed operator's output chains on as Flink's
    // `SingleOutputStreamOperator` does: `Deref` hands out only a borrowed stream, and they
    // consume theirs.

    /// See [`Stream::map`].
    pub fn map<U: Data>(self, f: impl Fn(O) -> U + Send + Sync + 'static) -> Stream<U> {
        self.stream.map(f)
    }

    /// See [`Stream::filter`].
    pub fn filter(self, f: impl Fn(&O) -> bool + Send + Sync + 'static) -> Stream<O> {
        self.stream.filter(f)
    }

    /// See [`Stream::flat_map`].
    pub fn flat_map<U: Data, I: IntoIterator<Item = U>>(
        self,
        f: impl Fn(O) -> I + Send + Sync + 'static,
    ) -> Stream<U> {
        self.stream.flat_map(f)
    }

    /// See [`Stream::filter_map`].
    pub fn filter_map<U: Data>(
        self,
        f: impl Fn(O) -> Option<U> + Send + Sync + 'static,
    ) -> Stream<U> {
        self.stream.filter_map(f)
    }

    /// See [`Stream::inspect`].
    pub fn inspect(self, f: impl Fn(&O) + Send + Sync + 'static) -> Stream<O> {
        self.stream.inspect(f)
    }

    /// See [`Stream::union`].
    pub fn union(self, other: impl Into<Stream<O>>) -> Stream<O> {
        self.stream.union(other)
    }

    /// See [`Stream::rebalance`].
    pub fn rebalance(self) -> Stream<O> {
        self.stream.rebalance()
    }

    /// See [`Stream::broadcast`].
    pub fn broadcast(self) -> Stream<O> {
        self.stream.broadcast()
    }

    /// See [`Stream::key_by`].
    pub fn key_by<K2, F>(self, key: F) -> KeyedStream<O, K2>
    where
        K2: Key,
        F: Fn(&O) -> K2 + Send + Sync + 'static,
    {
        self.stream.key_by(key)
    }

    /// See [`Stream::assign_timestamps`].
    pub fn assign_timestamps(self, strategy: crate::time::WatermarkStrategy<O>) -> Stream<O> {
        self.stream.assign_timestamps(strategy)
    }

    /// See [`Stream::sink`].
    pub fn sink(self, sink: impl crate::sink::Sink<O>) -> crate::stream::StreamSink {
        self.stream.sink(sink)
    }

    /// See [`Stream::collect`].
    pub fn collect(self) -> crate::sink::Collected<O> {
        self.stream.collect()
    }

    /// See [`Stream::for_each`].
    pub fn for_each(self, f: impl Fn(O) + Send + Sync + 'static) {
        self.stream.for_each(f)
    }

    /// See [`Stream::write_lines`].
    pub fn write_lines(
        self,
        dir: impl Into<std::path::PathBuf>,
        format: impl Fn(&O, &mut String) + Send + Sync + 'static,
    ) -> crate::stream::StreamSink {
        self.stream.write_lines(dir, format)
    }
}

impl<O> std::ops::Deref for ProcessStream<O> {
    type Target = Stream<O>;
    fn deref(&self) -> &Stream<O> {
        &self.stream
    }
}

impl<O: Data> From<ProcessStream<O>> for Stream<O> {
    fn from(p: ProcessStream<O>) -> Self {
        p.stream
    }
}

/// Flink's AggregateFunction: an accumulator per key (or window).
pub trait AggregateFunction<I, A, O>: Send + Sync + 'static {
    fn create(&self) -> A;
    fn add(&self, acc: A, value: I) -> A;
    fn result(&self, acc: &A) -> O;
    /// Combines two accumulators (session windows merge).
    fn merge(&self, a: A, b: A) -> A;
}

/// Which clock a timer follows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum TimeDomain {
    EventTime,
    ProcessingTime,
}

/// Per-record logic with keyed state and timers (Flink's KeyedProcessFunction).
pub trait KeyedProcessFunction<K, I, O>: Send + Sync + 'static {
    fn process_element(&self, rec: I, ctx: &mut KeyedContext<'_, K, O>);
    fn on_timer(&self, _timestamp: i64, _domain: TimeDomain, _ctx: &mut KeyedContext<'_, K, O>) {}
}

/// A [`KeyedProcessFunction`] from a closure that only processes elements.
pub struct FnProcess<F>(F);

impl<F> FnProcess<F> {
    pub fn new(f: F) -> Self {
        Self(f)
    }
}

impl<K, I, O, F> KeyedProcessFunction<K, I, O> for FnProcess<F>
where
    F: Fn(I, &mut KeyedContext<'_, K, O>) + Send + Sync + 'static,
{
    fn process_element(&self, rec: I, ctx: &mut KeyedContext<'_, K, O>) {
        (self.0)(rec, ctx)
    }
}

/// Where a pending timer belongs: its time, then key group, key and namespace.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct TimerKey {
    pub ts: i64,
    pub key_group: u16,
    pub key: Vec<u8>,
    pub namespace: Vec<u8>,
}

/// Timers of one keyed operator on one shard, by clock, ordered by time. Each timer keeps the
/// key object it was registered for, so that `on_timer` hands the user a `&K` without decoding.
pub(crate) struct TimerQueues<K> {
    pub event: BTreeMap<TimerKey, K>,
    pub processing: BTreeMap<TimerKey, K>,
}

impl<K> Default for TimerQueues<K> {
    fn default() -> Self {
        Self {
            event: BTreeMap::new(),
            processing: BTreeMap::new(),
        }
    }
}

#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
struct TimerRecord {
    domain: u8,
    ts: i64,
    key_group: u16,
    key: Vec<u8>,
    namespace: Vec<u8>,
}

impl<K: Key> TimerQueues<K> {
    /// The timers, encoded for a checkpoint.
    pub fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(self.event.len() + self.processing.len());
        for (domain, q) in [(0u8, &self.event), (1u8, &self.processing)] {
            for t in q.keys() {
                v.push(TimerRecord {
                    domain,
                    ts: t.ts,
                    key_group: t.key_group,
                    key: t.key.clone(),
                    namespace: t.namespace.clone(),
                });
            }
        }
        crate::checkpoint::snapshot::encode(&v)
    }

    /// The timers of a restored checkpoint whose key groups `shard` owns.
    pub fn restored(
        state: &ShardState,
        operator: &str,
        shard: usize,
    ) -> Result<Self, crate::StartError> {
        let mut q = Self::default();
        let range = state.key_group_range();
        for bytes in state.take_restored_timers() {
            let records: Vec<TimerRecord> = crate::checkpoint::snapshot::decode_any(&bytes)
                .map_err(|e| crate::StartError::State {
                    shard,
                    reason: format!("timers of `{operator}`: {e}"),
                })?;
            for r in records.into_iter().filter(|r| range.contains(r.key_group)) {
                // Every byte of the key, or it is another type's: 8 bytes of a u64 key read
                // as an empty `String` fired timers under the wrong key.
                let mut input = r.key.as_slice();
                let key = K::decode_key(&mut input)
                    .filter(|_| input.is_empty())
                    .ok_or_else(|| crate::StartError::State {
                        shard,
                        reason: format!(
                            "timers of `{operator}`: a timer's key ({} bytes) does not decode as {}",
                            r.key.len(),
                            weir_state::short_type_name::<K>()
                        ),
                    })?;
                let t = TimerKey {
                    ts: r.ts,
                    key_group: r.key_group,
                    key: r.key,
                    namespace: r.namespace,
                };
                let d = if r.domain == 0 {
                    TimeDomain::EventTime
                } else {
                    TimeDomain::ProcessingTime
                };
                q.queue(d).insert(t, key);
            }
        }
        Ok(q)
    }
}

impl<K> TimerQueues<K> {
    pub fn queue(&mut self, d: TimeDomain) -> &mut BTreeMap<TimerKey, K> {
        match d {
            TimeDomain::EventTime => &mut self.event,
            TimeDomain::ProcessingTime => &mut self.processing,
        }
    }

    /// Removes and returns the earliest timer of `d` at or before `upto`.
    pub fn pop_due(&mut self, d: TimeDomain, upto: i64) -> Option<(TimerKey, K)> {
        let q = self.queue(d);
        if q.first_key_value().is_some_and(|(t, _)| t.ts <= upto) {
            q.pop_first()
        } else {
            None
        }
    }
}

/// The state every keyed operator instance keeps beside its user logic.
pub(crate) struct OpState {
    pub name: String,
    pub shard: usize,
    pub state: ShardState,
    pub fail: FailCell,
    /// The operator's event-time watermark: checkpointed, and restored, so that a record after
    /// a restore is late exactly when it would have been without one (see [`Self::snapshot`]).
    pub watermark: i64,
    pub now_ms: i64,
    checkpoint: Option<crate::checkpoint::shard::ShardCheckpointRef>,
    pub max_parallelism: u16,
    /// Encoded current key and its key group.
    pub key_bytes: Vec<u8>,
    pub key_group: u16,
    /// Resolved state ids by name: a handful per operator, scanned linearly.
    ids: Vec<(&'static str, StateId)>,
}

impl OpState {
    /// Opens the operator's store (restored when the job restores) and registers the
    /// operator as a checkpoint participant. Its state is keyed by `K`: a restore of a
    /// checkpoint that recorded another key type is refused (see `ShardState::set_key_type`).
    pub fn new<K: ?Sized>(name: &str, ctx: &mut BuildCtx) -> Result<Self, crate::StartError> {
        let state = ctx.open_state(name)?;
        state
            .set_key_type(format!("key<{}>", weir_state::short_type_name::<K>()))
            .map_err(|e| crate::StartError::Restore {
                reason: format!("operator `{name}`: {e}"),
            })?;
        if let Some(c) = &ctx.checkpoint {
            // Two parts a checkpoint: the keyed state (with timers) and the watermark.
            let mut c = c.borrow_mut();
            c.register();
            c.register();
        }
        // State TTL counts from processing time; until the first tick arrives, from the wall
        // clock (not 0, against which a TTL'd write would already be expired once time ran).
        state.set_now_ms(crate::shard::now_ms());
        Ok(Self {
            name: name.to_string(),
            shard: ctx.shard,
            state,
            fail: ctx.fail.clone(),
            watermark: crate::time::restored_watermark(ctx, name)?,
            now_ms: i64::MIN,
            checkpoint: ctx.checkpoint.clone(),
            max_parallelism: ctx.config.max_parallelism,
            key_bytes: Vec::with_capacity(64),
            key_group: 0,
            ids: Vec::new(),
        })
    }

    /// Checkpoint `id` reached the operator: its keyed state and `timers` (see
    /// [`ShardState::snapshot`]), and its watermark.
    pub fn snapshot(&mut self, id: u64, timers: Vec<u8>) {
        self.state.snapshot(id, timers);
        crate::time::report_watermark(self.checkpoint.as_ref(), id, &self.name, self.watermark);
    }

    /// Whether checkpoint `id` is the job's final one, taken once every source has ended.
    pub fn is_final_checkpoint(&self, id: u64) -> bool {
        self.checkpoint
            .as_ref()
            .is_some_and(|c| c.borrow().shared.is_final(id))
    }

    /// Processing time advanced to `now_ms`: timers compare against it, and so do the
    /// expiries of states with a TTL.
    pub fn set_processing_time(&mut self, now_ms: i64) {
        self.now_ms = now_ms;
        self.state.set_now_ms(now_ms);
    }

    /// State `name` of this operator expires `ttl_ms` after each write.
    pub fn set_ttl(&mut self, name: &str, ttl_ms: u64) -> Result<(), crate::StartError> {
        let id = self
            .state
            .state_id(&format!("{}/{}", self.name, name))
            .map_err(|e| crate::StartError::State {
                shard: self.shard,
                reason: format!("operator `{}`: {e}", self.name),
            })?;
        self.state.set_ttl(&id, ttl_ms);
        Ok(())
    }

    /// A watermark from upstream. Watermarks only advance: after a restore the operator's
    /// own restored one stands until upstream passes it.
    pub fn advance_watermark(&mut self, w: i64) -> i64 {
        self.watermark = self.watermark.max(w);
        self.watermark
    }

    #[inline]
    /// Make `key` the current key. False, with the operator's failure recorded, for a key
    /// longer than keyed state takes (`weir_state::MAX_KEY_BYTES`): the caller drops the
    /// record, and the job fails naming the operator and the key's length.
    #[must_use]
    pub fn set_key<K: KeyCodec>(&mut self, key: &K) -> bool {
        self.key_bytes.clear();
        key.encode_key(&mut self.key_bytes);
        if self.key_bytes.len() > weir_state::MAX_KEY_BYTES {
            self.fail.fail(crate::JobError::Operator {
                operator: self.name.clone(),
                shard: self.shard,
                message: weir_state::StateError::KeyTooLong {
                    what: "key",
                    len: self.key_bytes.len(),
                    max: weir_state::MAX_KEY_BYTES,
                }
                .to_string(),
            });
            return false;
        }
        self.key_group = key_group_of(&self.key_bytes, self.max_parallelism);
        true
    }

    /// The first `n` states the operator used (ids are a few `Copy` words).
    #[inline]
    pub fn hot_ids(&self, n: usize) -> impl Iterator<Item = &StateId> + '_ {
        self.ids.iter().take(n).map(|(_, id)| id)
    }

    #[inline]
    pub fn id(&mut self, name: &'static str) -> Result<StateId, crate::backend::StateError> {
        if let Some((_, id)) = self
            .ids
            .iter()
            .find(|(n, _)| std::ptr::eq(*n, name) || *n == name)
        {
            return Ok(*id);
        }
        let id = self.state.state_id(&format!("{}/{}", self.name, name))?;
        self.ids.push((name, id));
        Ok(id)
    }
}

/// What a keyed process function sees: the current key, its state, timers, and the output.
pub struct KeyedContext<'a, K, O> {
    pub(crate) key: &'a K,
    pub(crate) ts: i64,
    /// The timestamp [`Self::emit`] gives output: `ts`, but none in a processing-time timer
    /// (Flink's `KeyedProcessOperator` erases it there, while `timestamp()` is the timer's).
    pub(crate) out_ts: i64,
    pub(crate) op: &'a mut OpState,
    pub(crate) timers: &'a mut TimerQueues<K>,
    pub(crate) namespace: &'a [u8],
    pub(crate) out: &'a mut Out<O>,
    pub(crate) emitted: u64,
}

impl<K: Clone, O: 'static> KeyedContext<'_, K, O> {
    /// The key of the record or timer being processed.
    pub fn key(&self) -> &K {
        self.key
    }

    /// The event timestamp of the record (or the timer's time), if any. `i64::MIN` is weir's
    /// mark for no timestamp, so a record or an event-time timer at `i64::MIN` reads as none
    /// (Flink keeps a separate flag; its window assigners take `Long.MIN_VALUE` as none too).
    pub fn timestamp(&self) -> Option<i64> {
        (self.ts != NO_TS).then_some(self.ts)
    }

    /// The operator's current event-time watermark.
    pub fn current_watermark(&self) -> i64 {
        self.op.watermark
    }

    /// The operator's current processing time (milliseconds since the epoch).
    pub fn current_processing_time(&self) -> i64 {
        self.op.now_ms
    }

    /// Emits a record with the current timestamp: the record's, or an event-time timer's
    /// time; none in a processing-time timer.
    pub fn emit(&mut self, rec: O) {
        self.emitted += 1;
        self.out.collect(rec, self.out_ts);
    }

    /// Emits a record with an explicit event timestamp.
    pub fn emit_at(&mut self, rec: O, ts: i64) {
        self.emitted += 1;
        self.out.collect(rec, ts);
    }

    /// Runs one state access for the current key and namespace; a failure (corrupt bytes, an
    /// I/O error of the store) fails the job with the state's name, and the access yields
    /// `None`.
    fn access<R>(
        &mut self,
        name: &'static str,
        doing: &str,
        f: impl FnOnce(
            &ShardState,
            &StateId,
            u16,
            &[u8],
            &[u8],
        ) -> Result<R, crate::backend::StateError>,
    ) -> Option<R> {
        let op = &mut *self.op;
        let r = op
            .id(name)
            .and_then(|id| f(&op.state, &id, op.key_group, &op.key_bytes, self.namespace));
        match r {
            Ok(r) => Some(r),
            Err(e) => {
                let (operator, shard) = (op.name.clone(), op.shard);
                let message = format!("{doing} state `{name}`: {e}");
                // The job as written: a restart would meet it again.
                let as_written = matches!(
                    e,
                    weir_state::StateError::TypeMismatch { .. }
                        | weir_state::StateError::RestoredTypeMismatch { .. }
                        | weir_state::StateError::NameCollision { .. }
                );
                op.fail.fail(if as_written {
                    crate::JobError::StateType {
                        operator,
                        shard,
                        message,
                    }
                } else {
                    crate::JobError::Operator {
                        operator,
                        shard,
                        message,
                    }
                });
                None
            }
        }
    }

    /// The current key's value of state `name`.
    pub fn value<V: Data>(&mut self, name: &'static str) -> Option<V> {
        self.access(name, "reading", |s, id, kg, k, ns| {
            s.value_get::<V>(id, kg, k, ns)
        })
        .flatten()
    }

    /// Sets the current key's value of state `name`.
    pub fn set_value<V: Data>(&mut self, name: &'static str, v: &V) {
        self.access(name, "writing", |s, id, kg, k, ns| {
            s.value_put(id, kg, k, ns, v)
        });
    }

    /// Clears the current key's value of state `name`.
    pub fn clear_value(&mut self, name: &'static str) {
        self.access(name, "clearing", |s, id, kg, k, ns| s.delete(id, kg, k, ns));
    }

    /// Clears the current key's list state `name`.
    pub fn clear_list(&mut self, name: &'static str) {
        self.access(name, "clearing", |s, id, kg, k, ns| {
            s.list_clear(id, kg, k, ns)
        });
    }

    /// Appends to the current key's list state `name` without reading it.
    pub fn append<V: Data>(&mut self, name: &'static str, v: &V) {
        self.access(name, "appending to", |s, id, kg, k, ns| {
            s.list_append(id, kg, k, ns, v)
        });
    }

    /// The current key's list state `name`.
    pub fn list<V: Data>(&mut self, name: &'static str) -> Vec<V> {
        self.access(name, "reading", |s, id, kg, k, ns| {
            s.list_get::<V>(id, kg, k, ns)
        })
        .unwrap_or_default()
    }

    /// The current key's entry `mk` of map state `name` (Flink's `MapState::get`).
    pub fn map_get<M: weir_state::KeyCodec + ?Sized + 'static, V: Data>(
        &mut self,
        name: &'static str,
        mk: &M,
    ) -> Option<V> {
        self.access(name, "reading", |s, id, kg, k, ns| {
            s.map_get::<M, V>(id, (kg, k, ns), mk)
        })
        .flatten()
    }

    /// Sets the current key's entry `mk` of map state `name`.
    pub fn map_put<M: weir_state::KeyCodec + ?Sized + 'static, V: Data>(
        &mut self,
        name: &'static str,
        mk: &M,
        v: &V,
    ) {
        self.access(name, "writing", |s, id, kg, k, ns| {
            s.map_put(id, (kg, k, ns), mk, v)
        });
    }

    /// Removes the current key's entry `mk` of map state `name`.
    pub fn map_remove<M: weir_state::KeyCodec + ?Sized + 'static>(
        &mut self,
        name: &'static str,
        mk: &M,
    ) {
        self.access(name, "removing from", |s, id, kg, k, ns| {
            s.map_remove(id, (kg, k, ns), mk)
        });
    }

    /// The current key's entries of map state `name`, in map-key order (the order of their
    /// encoded keys: numbers ascending, strings by their bytes).
    pub fn map_entries<M: weir_state::KeyCodec + ?Sized + 'static, V: Data>(
        &mut self,
        name: &'static str,
    ) -> Vec<(M::Owned, V)> {
        self.access(name, "reading", |s, id, kg, k, ns| {
            s.map_entries::<M, V>(id, (kg, k, ns))
        })
        .unwrap_or_default()
    }

    /// Clears the current key's map state `name`.
    pub fn clear_map(&mut self, name: &'static str) {
        self.access(name, "clearing", |s, id, kg, k, ns| {
            s.map_clear(id, kg, k, ns)
        });
    }

    /// Adds `v` to the current key's reducing state `name` (Flink's `ReducingState::add`):
    /// the state becomes `reduce(old, v)`, or `v` when it is empty. Returns the new value
    /// (`None` only when the state could not be read or written: the job then fails). Read it
    /// with [`Self::value`], clear it with [`Self::clear_value`].
    pub fn reducing_add<V: Data>(
        &mut self,
        name: &'static str,
        v: V,
        reduce: impl FnOnce(V, V) -> V,
    ) -> Option<V> {
        self.access(name, "reducing into", |s, id, kg, k, ns| {
            s.value_update(id, (kg, k, ns), |old: Option<V>| match old {
                Some(old) => reduce(old, v),
                None => v,
            })
        })
    }

    /// Adds `v` to the current key's aggregating state `name` (Flink's
    /// `AggregatingState::add`): `agg.add` into its accumulator, created by `agg.create` when
    /// the state is empty. Returns `agg.result` of the new accumulator (`None` only when the
    /// state could not be read or written: the job then fails).
    pub fn aggregating_add<I, A: Data, R>(
        &mut self,
        name: &'static str,
        agg: &impl AggregateFunction<I, A, R>,
        v: I,
    ) -> Option<R> {
        self.access(name, "aggregating into", |s, id, kg, k, ns| {
            s.value_update(id, (kg, k, ns), |acc: Option<A>| {
                agg.add(acc.unwrap_or_else(|| agg.create()), v)
            })
        })
        .map(|acc| agg.result(&acc))
    }

    /// `agg.result` of the current key's aggregating state `name` (Flink's
    /// `AggregatingState::get`); `None` when it is empty. Clear it with [`Self::clear_value`].
    pub fn aggregating_get<I, A: Data, R>(
        &mut self,
        name: &'static str,
        agg: &impl AggregateFunction<I, A, R>,
    ) -> Option<R> {
        self.value::<A>(name).map(|acc| agg.result(&acc))
    }

    /// Registers a timer for the current key at `ts` on `domain`'s clock. Registering the same
    /// time twice for a key keeps one timer.
    pub fn register_timer(&mut self, domain: TimeDomain, ts: i64) {
        let t = self.timer_key(ts);
        self.timers.queue(domain).insert(t, self.key.clone());
    }

    fn timer_key(&self, ts: i64) -> TimerKey {
        TimerKey {
            ts,
            key_group: self.op.key_group,
            key: self.op.key_bytes.clone(),
            namespace: self.namespace.to_vec(),
        }
    }

    /// Registers an event-time timer for the current key.
    pub fn register_event_timer(&mut self, ts: i64) {
        self.register_timer(TimeDomain::EventTime, ts)
    }

    /// Registers a processing-time timer for the current key. As in Flink, one not yet due
    /// when the input ends never fires: with checkpoints, those pending at the final
    /// checkpoint (taken once every source has ended) are dropped at its barrier.
    pub fn register_processing_timer(&mut self, ts: i64) {
        self.register_timer(TimeDomain::ProcessingTime, ts)
    }

    /// Deletes a timer of the current key.
    pub fn delete_timer(&mut self, domain: TimeDomain, ts: i64) {
        let t = self.timer_key(ts);
        self.timers.queue(domain).remove(&t);
    }
}

/// A keyed process operator on one shard.
struct KeyedOp<K, I, O, P> {
    f: Arc<P>,
    key: KeyFn<I, K>,
    ops: OpState,
    timers: TimerQueues<K>,
    counters: Arc<OperatorCounters>,
    down: Out<O>,
    ahead: Lookahead,
    _p: PhantomData<fn(I) -> O>,
}

/// Records hinted but not yet processed, as the store-key hashes of their value state.
///
/// The keyed path is bound by two dependent cache misses per record (the memtable's index
/// slot, then the record). The exchange hands each record over [`LOOKAHEAD`] records before
/// processing it ([`Collector::hint`]); the slot is prefetched then, and the record half-way,
/// once the slot has arrived. State ids are the ones the function used so far (an operator
/// reads the same few states for every record), without namespace: prefetches for states the
/// function will not read only cost a wasted load.
#[derive(Default)]
struct Lookahead {
    hashes: std::collections::VecDeque<u64>,
    key: Vec<u8>,
}

/// How many records ahead of processing a record is hinted (see `exchange.rs`).
pub(crate) const LOOKAHEAD: usize = 8;
/// Value states prefetched per record.
const PREFETCH_STATES: usize = 2;

/// Fires the timers of `domain` due at `upto`, in time order; returns the records emitted.
pub(crate) fn fire_timers<K: Clone, O: 'static>(
    ops: &mut OpState,
    timers: &mut TimerQueues<K>,
    domain: TimeDomain,
    upto: i64,
    down: &mut Out<O>,
    mut on_timer: impl FnMut(i64, TimeDomain, &mut KeyedContext<'_, K, O>),
) -> u64 {
    let mut emitted = 0;
    while let Some((t, key)) = timers.pop_due(domain, upto) {
        ops.key_bytes.clear();
        ops.key_bytes.extend_from_slice(&t.key);
        ops.key_group = t.key_group;
        let out_ts = if domain == TimeDomain::EventTime {
            t.ts
        } else {
            NO_TS
        };
        let mut ctx = KeyedContext {
            key: &key,
            ts: t.ts,
            out_ts,
            op: ops,
            timers,
            namespace: &t.namespace,
            out: down,
            emitted: 0,
        };
        on_timer(t.ts, domain, &mut ctx);
        emitted += ctx.emitted;
    }
    emitted
}

impl<K, I, O, P> Collector<I> for KeyedOp<K, I, O, P>
where
    K: Key,
    I: Data,
    O: Data,
    P: KeyedProcessFunction<K, I, O>,
{
    fn wants_hints(&self) -> bool {
        true
    }

    #[inline]
    fn hint(&mut self, rec: &I) {
        let key = (self.key)(rec);
        let a = &mut self.ahead;
        a.key.clear();
        key.encode_key(&mut a.key);
        if a.key.len() > weir_state::MAX_KEY_BYTES {
            // `collect` fails the job on this record; nothing to load for it.
            return;
        }
        let kg = key_group_of(&a.key, self.ops.max_parallelism);
        let mut n = 0;
        for id in self.ops.hot_ids(PREFETCH_STATES) {
            a.hashes
                .push_back(self.ops.state.prefetch_value(id, kg, &a.key, &[]));
            n += 1;
        }
        // Records are collected LOOKAHEAD hints after their own: load them half-way there.
        while a.hashes.len() > n * LOOKAHEAD / 2 {
            if let Some(h) = a.hashes.pop_front() {
                self.ops.state.prefetch_record(h);
            }
        }
    }

    #[inline]
    fn collect(&mut self, rec: I, ts: i64) {
        bump(&self.counters.records_in, 1);
        let key = (self.key)(&rec);
        if !self.ops.set_key(&key) {
            return;
        }
        let mut ctx = KeyedContext {
            key: &key,
            ts,
            out_ts: ts,
            op: &mut self.ops,
            timers: &mut self.timers,
            namespace: &[],
            out: &mut self.down,
            emitted: 0,
        };
        self.f.process_element(rec, &mut ctx);
        let n = ctx.emitted;
        bump(&self.counters.records_out, n);
    }

    fn event(&mut self, ev: Event) {
        match ev {
            Event::Barrier(id) if self.ops.is_final_checkpoint(id) => {
                // Every source has ended: as Flink quiesces an operator's processing-time
                // service at the end of its input (FLINK-14231), timers not yet due never
                // fire. Fired after this barrier, their output would be published outside any
                // checkpoint; kept in it, a restore of the finished job would fire them.
                // Those due by now fire first, as they would have at the next step.
                self.fire_due_processing_timers();
                self.timers.processing.clear();
            }
            // Its head steps no more: timers registered due in this step (at or before the
            // current time) fire now, as at the next step; they were dropped, and the output
            // depended on whether the end came in the same step as their records.
            Event::EndOfInput => self.fire_due_processing_timers(),
            _ => {}
        }
        if let Event::Barrier(id) = ev {
            self.ops.snapshot(id, self.timers.encode());
        }
        if let Event::Watermark(w) = ev {
            let w = self.ops.advance_watermark(w);
            let f = &self.f;
            let n = fire_timers(
                &mut self.ops,
                &mut self.timers,
                TimeDomain::EventTime,
                w,
                &mut self.down,
                |ts, d, c| f.on_timer(ts, d, c),
            );
            bump(&self.counters.records_out, n);
        }
        self.down.event(ev);
    }

    fn processing_time(&mut self, now_ms: i64) {
        if now_ms != self.ops.now_ms {
            self.ops.set_processing_time(now_ms);
        }
        // Also when the time did not move: a timer registered at or before it since (in
        // a record's or a timer's callback) is due now, as Flink fires a timer registered in
        // the past at once. It waited for the next tick, which the test driver only gives
        // when the test sets another time.
        self.fire_due_processing_timers();
        self.down.processing_time(now_ms);
    }
}

impl<K, I, O, P> KeyedOp<K, I, O, P>
where
    K: Key,
    I: Data,
    O: Data,
    P: KeyedProcessFunction<K, I, O>,
{
    /// Fires the processing-time timers due at the operator's current processing time.
    fn fire_due_processing_timers(&mut self) {
        if self.timers.processing.is_empty() {
            return;
        }
        let (f, now_ms) = (&self.f, self.ops.now_ms);
        let n = fire_timers(
            &mut self.ops,
            &mut self.timers,
            TimeDomain::ProcessingTime,
            now_ms,
            &mut self.down,
            |ts, d, c| f.on_timer(ts, d, c),
        );
        bump(&self.counters.records_out, n);
    }
}
