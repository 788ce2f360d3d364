//! Event-time windows per key: tumbling, sliding and session windows, with reduce, aggregate
//! and process-window functions, and allowed lateness (Flink's WindowOperator semantics).
//!
//! A window's contents live in keyed state namespaced by the window. Each window has an
//! event-time timer at its last millisecond (`end - 1`): when the watermark passes it, the
//! window fires. With allowed lateness the contents stay until `end - 1 + lateness`; a late
//! record within that bound updates the window and fires it again; a record later than that
//! is dropped and counted.

use std::marker::PhantomData;
use std::sync::Arc;

use crate::data::Data;
use crate::exchange::exchange;
use crate::graph::{name_of, BuildCtx, Factory};
use crate::keyed::{
    fire_timers, key_route, AggregateFunction, Key, KeyFn, KeyedContext, KeyedStream, OpState,
    TimeDomain, TimerQueues,
};
use crate::metrics::{bump, OperatorCounters};
use crate::operator::{Collector, Event, Out};
use crate::stream::Stream;

/// A window of event time: `[start, end)` in milliseconds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Window {
    pub start: i64,
    pub end: i64,
}

impl Window {
    /// The last timestamp that belongs to the window.
    pub fn max_timestamp(&self) -> i64 {
        self.end - 1
    }

    fn encode(&self) -> [u8; 16] {
        let mut b = [0u8; 16];
        b[..8].copy_from_slice(&((self.start as u64) ^ (1 << 63)).to_be_bytes());
        b[8..].copy_from_slice(&((self.end as u64) ^ (1 << 63)).to_be_bytes());
        b
    }

    fn decode(b: &[u8]) -> Option<Window> {
        let s = u64::from_be_bytes(b.get(..8)?.try_into().ok()?) ^ (1 << 63);
        let e = u64::from_be_bytes(b.get(8..16)?.try_into().ok()?) ^ (1 << 63);
        Some(Window {
            start: s as i64,
            end: e as i64,
        })
    }

    fn intersects(&self, o: &Window) -> bool {
        self.start <= o.end && self.end >= o.start
    }
}

/// How records are assigned to windows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WindowAssigner {
    Tumbling {
        size_ms: i64,
        /// Less than `size_ms` either way, else the job does not start (as in Flink).
        offset_ms: i64,
    },
    Sliding {
        size_ms: i64,
        slide_ms: i64,
        /// Less than `slide_ms` either way, else the job does not start (as in Flink).
        offset_ms: i64,
    },
    Session {
        gap_ms: i64,
    },
}

impl WindowAssigner {
    /// Windows of `size_ms`, more than 0: as in Flink, a job with another size does not
    /// start (it was made 1 ms without a word).
    pub fn tumbling(size_ms: i64) -> Self {
        WindowAssigner::Tumbling {
            size_ms,
            offset_ms: 0,
        }
    }

    /// Windows of `size_ms` every `slide_ms` (both more than 0).
    pub fn sliding(size_ms: i64, slide_ms: i64) -> Self {
        WindowAssigner::Sliding {
            size_ms,
            slide_ms,
            offset_ms: 0,
        }
    }

    /// Sessions closed by a gap of `gap_ms` (more than 0).
    pub fn session(gap_ms: i64) -> Self {
        WindowAssigner::Session { gap_ms }
    }

    /// Why the assigner's sizes make no windows, if they do not: the job does not start. An
    /// offset must be less than the size (tumbling) or slide (sliding) either way, as Flink's
    /// assigners require: a larger one only stands for a smaller, and is likelier a mistake
    /// (seconds for milliseconds) than meant.
    pub fn check(&self) -> Result<(), String> {
        let positive = |what: &str, v: i64| {
            if v > 0 {
                Ok(())
            } else {
                Err(format!("a window's {what} must be more than 0 ms, not {v}"))
            }
        };
        let offset = |offset: i64, what: &str, of: i64| {
            if offset.unsigned_abs() < of.unsigned_abs() {
                Ok(())
            } else {
                Err(format!(
                    "a window's offset must be less than its {what} either way, not {offset} ms \
                     for a {what} of {of} ms"
                ))
            }
        };
        match *self {
            WindowAssigner::Tumbling { size_ms, offset_ms } => {
                positive("size", size_ms).and(offset(offset_ms, "size", size_ms))
            }
            WindowAssigner::Sliding {
                size_ms,
                slide_ms,
                offset_ms,
            } => positive("size", size_ms)
                .and(positive("slide", slide_ms))
                .and(offset(offset_ms, "slide", slide_ms)),
            WindowAssigner::Session { gap_ms } => positive("session gap", gap_ms),
        }
    }

    /// The windows `ts` belongs to (for sessions: its own window before merging). A
    /// timestamp so near either end of the i64 range that one of its windows would start or
    /// end outside it has no windows: an error, never a window cut short or wrapped around.
    pub fn assign(&self, ts: i64, out: &mut Vec<Window>) -> Result<(), WindowRangeError> {
        out.clear();
        // Sizes of 0 or less make no window (a job refuses them, and offsets not less than
        // the size or slide, before it starts).
        if self.check().is_err() {
            return Err(WindowRangeError {
                ts,
                assigner: *self,
            });
        }
        // In i128, where no step overflows; each window is checked into i64 at the end.
        let window = |start: i128, size: i64| {
            let end = start + i128::from(size);
            match (i64::try_from(start), i64::try_from(end)) {
                (Ok(start), Ok(end)) => Ok(Window { start, end }),
                _ => Err(WindowRangeError {
                    ts,
                    assigner: *self,
                }),
            }
        };
        match *self {
            WindowAssigner::Tumbling { size_ms, offset_ms } => {
                out.push(window(start_in(ts, offset_ms, size_ms), size_ms)?);
            }
            WindowAssigner::Sliding {
                size_ms,
                slide_ms,
                offset_ms,
            } => {
                let mut start = start_in(ts, offset_ms, slide_ms);
                while start > i128::from(ts) - i128::from(size_ms) {
                    match window(start, size_ms) {
                        Ok(w) => out.push(w),
                        Err(e) => {
                            // None of its windows, rather than some.
                            out.clear();
                            return Err(e);
                        }
                    }
                    start -= i128::from(slide_ms);
                }
            }
            WindowAssigner::Session { gap_ms } => out.push(window(ts.into(), gap_ms)?),
        }
        Ok(())
    }

    fn is_session(&self) -> bool {
        matches!(self, WindowAssigner::Session { .. })
    }
}

/// The start of the window of `size` (shifted by `offset`) that holds `ts`, for negative
/// timestamps too (Flink's TimeWindow.getWindowStartWithOffset); `None` when it lies before
/// `i64::MIN` (or `size` is not positive).
pub fn window_start(ts: i64, offset: i64, size: i64) -> Option<i64> {
    if size <= 0 {
        return None;
    }
    i64::try_from(start_in(ts, offset, size)).ok()
}

/// [`window_start`] in i128, where it cannot overflow (`size` > 0).
fn start_in(ts: i64, offset: i64, size: i64) -> i128 {
    let ts = i128::from(ts);
    ts - (ts - i128::from(offset)).rem_euclid(i128::from(size))
}

/// A record's timestamp whose windows do not fit in the i64 millisecond range (or an
/// assigner whose sizes make no windows).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("timestamp {ts}: {assigner:?} gives it no window within the 64-bit millisecond range")]
pub struct WindowRangeError {
    pub ts: i64,
    pub assigner: WindowAssigner,
}

/// A keyed stream grouped into windows.
pub struct WindowedStream<T, K> {
    keyed: KeyedStream<T, K>,
    assigner: WindowAssigner,
    lateness_ms: i64,
}

/// How a window's contents are kept and turned into output.
trait Contents<K, T, R>: Send + Sync + 'static {
    /// Adds `rec` to the window of the context's namespace. Returns false when the window
    /// already held contents for this key, so that its timers are registered already.
    fn add(&self, ctx: &mut KeyedContext<'_, K, R>, rec: T) -> bool;
    /// Moves the contents of the context's namespace into window `into` (session merges).
    fn merge_into<'a>(&self, ctx: &mut KeyedContext<'a, K, R>, into: &'a [u8]);
    fn fire(&self, ctx: &mut KeyedContext<'_, K, R>, w: Window);
    fn clear(&self, ctx: &mut KeyedContext<'_, K, R>);
}

/// Contents folded into one accumulator (reduce and aggregate).
struct Folded<A, T, R, Add, Merge, Emit> {
    add: Add,
    merge: Merge,
    emit: Emit,
    _p: PhantomData<fn(A, T) -> R>,
}

impl<K, T, A, R, Add, Merge, Emit> Contents<K, T, R> for Folded<A, T, R, Add, Merge, Emit>
where
    K: Clone + 'static,
    T: Data,
    A: Data,
    R: Data,
    Add: Fn(Option<A>, T) -> A + Send + Sync + 'static,
    Merge: Fn(A, A) -> A + Send + Sync + 'static,
    Emit: Fn(&K, Window, &A) -> R + Send + Sync + 'static,
{
    fn add(&self, ctx: &mut KeyedContext<'_, K, R>, rec: T) -> bool {
        let acc = ctx.value::<A>("window");
        let fresh = acc.is_none();
        let acc = (self.add)(acc, rec);
        ctx.set_value("window", &acc);
        fresh
    }

    fn merge_into<'a>(&self, ctx: &mut KeyedContext<'a, K, R>, into: &'a [u8]) {
        let Some(from) = ctx.value::<A>("window") else {
            return;
        };
        ctx.clear_value("window");
        let ns = ctx.namespace;
        ctx.namespace = into;
        let merged = match ctx.value::<A>("window") {
            Some(a) => (self.merge)(a, from),
            None => from,
        };
        ctx.set_value("window", &merged);
        ctx.namespace = ns;
    }

    fn fire(&self, ctx: &mut KeyedContext<'_, K, R>, w: Window) {
        if let Some(acc) = ctx.value::<A>("window") {
            let r = (self.emit)(ctx.key, w, &acc);
            ctx.emit_at(r, w.max_timestamp());
        }
    }

    fn clear(&self, ctx: &mut KeyedContext<'_, K, R>) {
        ctx.clear_value("window");
    }
}

/// Contents kept as the list of records (process-window functions).
struct Listed<T, R, F> {
    f: F,
    _p: PhantomData<fn(T) -> R>,
}

impl<K, T, R, F> Contents<K, T, R> for Listed<T, R, F>
where
    K: Clone + 'static,
    T: Data,
    R: Data,
    F: Fn(&K, Window, Vec<T>, &mut Vec<R>) + Send + Sync + 'static,
{
    fn add(&self, ctx: &mut KeyedContext<'_, K, R>, rec: T) -> bool {
        // Appends without reading the list: whether it was empty is unknown.
        ctx.append("window", &rec);
        true
    }

    fn merge_into<'a>(&self, ctx: &mut KeyedContext<'a, K, R>, into: &'a [u8]) {
        let from = ctx.list::<T>("window");
        ctx.clear_list("window");
        let ns = ctx.namespace;
        ctx.namespace = into;
        for r in &from {
            ctx.append("window", r);
        }
        ctx.namespace = ns;
    }

    fn fire(&self, ctx: &mut KeyedContext<'_, K, R>, w: Window) {
        let items = ctx.list::<T>("window");
        if items.is_empty() {
            return;
        }
        let mut out = Vec::new();
        (self.f)(ctx.key, w, items, &mut out);
        for r in out {
            ctx.emit_at(r, w.max_timestamp());
        }
    }

    fn clear(&self, ctx: &mut KeyedContext<'_, K, R>) {
        ctx.clear_list("window");
    }
}

impl<T: Data, K: Key> WindowedStream<T, K> {
    pub(crate) fn new(keyed: KeyedStream<T, K>, assigner: WindowAssigner) -> Self {
        Self {
            keyed,
            assigner,
            lateness_ms: 0,
        }
    }

    /// Keeps windows for `ms` after they fired, so that late records update them (0 or more:
    /// a job with a negative lateness does not start, as in Flink).
    pub fn allowed_lateness(mut self, ms: i64) -> Self {
        self.lateness_ms = ms;
        self
    }

    /// Reduces each window's records to one, emitted when the window fires.
    pub fn reduce(self, f: impl Fn(T, T) -> T + Send + Sync + 'static) -> Stream<T> {
        let f = Arc::new(f);
        let f2 = f.clone();
        self.build(
            "window_reduce",
            Folded {
                add: move |acc: Option<T>, t: T| match acc {
                    Some(a) => f(a, t),
                    None => t,
                },
                merge: move |a: T, b: T| f2(a, b),
                emit: |_: &K, _: Window, a: &T| a.clone(),
                _p: PhantomData,
            },
        )
    }

    /// Aggregates each window's records; emits `agg.result` when the window fires.
    pub fn aggregate<A: Data, O: Data>(self, agg: impl AggregateFunction<T, A, O>) -> Stream<O> {
        self.aggregate_with(agg, |_, _, o| o)
    }

    /// Aggregates each window's records; emits `f(key, window, agg.result)`.
    pub fn aggregate_with<A: Data, O: Data, R: Data>(
        self,
        agg: impl AggregateFunction<T, A, O>,
        f: impl Fn(&K, Window, O) -> R + Send + Sync + 'static,
    ) -> Stream<R> {
        let agg = Arc::new(agg);
        let (a1, a2, a3) = (agg.clone(), agg.clone(), agg);
        self.build(
            "window_aggregate",
            Folded {
                add: move |acc: Option<A>, t: T| a1.add(acc.unwrap_or_else(|| a1.create()), t),
                merge: move |a: A, b: A| a2.merge(a, b),
                emit: move |k: &K, w: Window, acc: &A| f(k, w, a3.result(acc)),
                _p: PhantomData,
            },
        )
    }

    /// Counts each window's records; emits `f(key, window, count)`.
    pub fn count_with<R: Data>(
        self,
        f: impl Fn(&K, Window, u64) -> R + Send + Sync + 'static,
    ) -> Stream<R> {
        self.build(
            "window_count",
            Folded {
                add: |acc: Option<u64>, _t: T| acc.unwrap_or(0) + 1,
                merge: |a: u64, b: u64| a + b,
                emit: move |k: &K, w: Window, n: &u64| f(k, w, *n),
                _p: PhantomData,
            },
        )
    }

    /// Calls `f(key, window, records, out)` with all of a window's records when it fires.
    pub fn process<R: Data>(
        self,
        f: impl Fn(&K, Window, Vec<T>, &mut Vec<R>) + Send + Sync + 'static,
    ) -> Stream<R> {
        self.build("window_process", Listed { f, _p: PhantomData })
    }

    fn build<R: Data, C: Contents<K, T, R>>(self, kind: &str, contents: C) -> Stream<R> {
        let up = self.keyed.up;
        let key = self.keyed.key;
        let checked = self.assigner.check().and(if self.lateness_ms < 0 {
            Err(format!(
                "allowed lateness must be 0 or more ms, not {}",
                self.lateness_ms
            ))
        } else {
            Ok(())
        });
        if let Err(e) = checked {
            // The job does not start (`Job::start`, `TestDriver::new` report it).
            up.errors.borrow_mut().push(format!("{kind}: {e}"));
        }
        let name = up.new_name(kind);
        let slot = name.clone();
        let (assigner, lateness) = (self.assigner, self.lateness_ms);
        let contents = Arc::new(contents);
        let exchanged = exchange(up, "key_by", key_route(key.clone()));
        let upf = exchanged.factory.clone();
        let factory: Factory<R> = Arc::new(move |ctx: &mut BuildCtx, down: Out<R>| {
            let name = name_of(&slot);
            let ops = OpState::new::<K>(&name, ctx)?;
            let op = WindowOp {
                key: key.clone(),
                contents: contents.clone(),
                assigner,
                lateness,
                timers: TimerQueues::restored(&ops.state, &name, ctx.shard)?,
                ops,
                counters: ctx.metrics.operator(&name, ctx.shard),
                windows: Vec::new(),
                down,
                _p: PhantomData,
            };
            upf(ctx, Box::new(op))
        });
        exchanged.derive(factory, name)
    }
}

struct WindowOp<K, T, R, C> {
    key: KeyFn<T, K>,
    contents: Arc<C>,
    assigner: WindowAssigner,
    lateness: i64,
    ops: OpState,
    timers: TimerQueues<K>,
    counters: Arc<OperatorCounters>,
    windows: Vec<Window>,
    down: Out<R>,
    _p: PhantomData<fn(T) -> R>,
}

impl<K, T, R, C> WindowOp<K, T, R, C>
where
    K: Key,
    T: Data,
    R: Data,
    C: Contents<K, T, R>,
{
    fn is_late(&self, w: &Window) -> bool {
        w.max_timestamp().saturating_add(self.lateness) <= self.ops.watermark
    }

    /// Merges `w` with the key's overlapping session windows; returns the merged window, or
    /// `None`, changing nothing, if that merged window is late. As Flink's `WindowOperator`
    /// (`addWindow`, then `isWindowLate` of the result): a record whose own session is late
    /// still joins a live session that its window touches, and widens it.
    fn merge_session(&mut self, key: &K, w: Window) -> Option<Window> {
        let mut sessions: Vec<(i64, i64)> = {
            let mut ctx = self.context(key, &[]);
            ctx.value::<Vec<(i64, i64)>>("sessions").unwrap_or_default()
        };
        let mut merged = w;
        let mut absorbed = Vec::new();
        // Repeat until nothing more intersects: absorbing one window can widen `merged` into
        // a window that was kept in an earlier pass.
        loop {
            let before = absorbed.len();
            sessions.retain(|&(s, e)| {
                let o = Window { start: s, end: e };
                if o.intersects(&merged) {
                    absorbed.push(o);
                    merged.start = merged.start.min(s);
                    merged.end = merged.end.max(e);
                    false
                } else {
                    true
                }
            });
            if absorbed.len() == before {
                break;
            }
        }
        if self.is_late(&merged) {
            // Every absorbed session ends no later, so it was late too: its cleanup timer
            // fired already and nothing of it is left to merge.
            return None;
        }
        let into = merged.encode();
        // Borrowed, not cloned (see `collect`).
        let contents = &*self.contents;
        let lateness = self.lateness;
        for o in absorbed {
            if o == merged {
                continue;
            }
            let ns = o.encode();
            let mut ctx = KeyedContext {
                key,
                ts: crate::operator::NO_TS,
                out_ts: crate::operator::NO_TS,
                op: &mut self.ops,
                timers: &mut self.timers,
                namespace: &ns,
                out: &mut self.down,
                emitted: 0,
            };
            contents.merge_into(&mut ctx, &into);
            ctx.delete_timer(TimeDomain::EventTime, o.max_timestamp());
            if lateness > 0 {
                ctx.delete_timer(
                    TimeDomain::EventTime,
                    o.max_timestamp().saturating_add(lateness),
                );
            }
        }
        sessions.push((merged.start, merged.end));
        let mut ctx = self.context(key, &[]);
        ctx.set_value("sessions", &sessions);
        Some(merged)
    }

    fn context<'a>(&'a mut self, key: &'a K, ns: &'a [u8]) -> KeyedContext<'a, K, R> {
        KeyedContext {
            key,
            ts: crate::operator::NO_TS,
            out_ts: crate::operator::NO_TS,
            op: &mut self.ops,
            timers: &mut self.timers,
            namespace: ns,
            out: &mut self.down,
            emitted: 0,
        }
    }
}

impl<K, T, R, C> Collector<T> for WindowOp<K, T, R, C>
where
    K: Key,
    T: Data,
    R: Data,
    C: Contents<K, T, R>,
{
    fn collect(&mut self, rec: T, ts: i64) {
        bump(&self.counters.records_in, 1);
        if ts == crate::operator::NO_TS {
            // Event-time windows need timestamps: assign them upstream.
            self.ops.fail.fail(crate::JobError::Operator {
                operator: self.ops.name.clone(),
                shard: self.ops.shard,
                message: "record without an event timestamp reached an event-time window; \
                          call assign_timestamps before key_by"
                    .into(),
            });
            return;
        }
        let key = (self.key)(&rec);
        if !self.ops.set_key(&key) {
            return;
        }
        let mut windows = std::mem::take(&mut self.windows);
        if let Err(e) = self.assigner.assign(ts, &mut windows) {
            self.ops.fail.fail(crate::JobError::Operator {
                operator: self.ops.name.clone(),
                shard: self.ops.shard,
                message: e.to_string(),
            });
            self.windows = windows;
            return;
        }
        if self.assigner.is_session() {
            match self.merge_session(&key, windows[0]) {
                Some(merged) => windows[0] = merged,
                None => windows.clear(),
            }
        } else {
            // Late windows drop out in place: no list allocated per record.
            windows.retain(|w| !self.is_late(w));
        }
        if windows.is_empty() {
            // A record counts as dropped once, and only when no window took it and it is late
            // itself (Flink's `numLateRecordsDropped`, `isSkippedElement && isElementLate`):
            // a sliding window's record that some of its windows still take is not dropped,
            // nor one in the gap between windows that slide further than they last, which no
            // window was to take.
            if ts.saturating_add(self.lateness) <= self.ops.watermark {
                bump(&self.counters.records_dropped, 1);
            }
            self.windows = windows;
            return;
        }
        let n = windows.len();
        let mut emitted = 0;
        let session = self.assigner.is_session();
        let mut rec = Some(rec);
        let (watermark, lateness) = (self.ops.watermark, self.lateness);
        // Borrowed, not cloned: a clone and drop per window and record is a locked increment
        // and decrement of a count that every shard's operator shares.
        let contents = &*self.contents;
        for (i, &w) in windows.iter().enumerate() {
            let ns = w.encode();
            let mut ctx = KeyedContext {
                key: &key,
                ts,
                out_ts: ts,
                op: &mut self.ops,
                timers: &mut self.timers,
                namespace: &ns,
                out: &mut self.down,
                emitted: 0,
            };
            // The last window takes the record itself; the others a copy.
            let r = if i + 1 == n { rec.take() } else { rec.clone() };
            let fresh = r.is_some_and(|r| contents.add(&mut ctx, r));
            // A timer per window and key, registered with its first record: one per record
            // was a timer-key allocation and a tree insert for every window of every record.
            // A merged session window got its contents by the merge, so it always registers.
            // Not the firing timer of a window the watermark passed (it fires at once below,
            // as Flink's event-time trigger does): a merged late session registered it, and
            // the next watermark fired the same window a second time.
            if fresh || session {
                if w.max_timestamp() > watermark {
                    ctx.register_event_timer(w.max_timestamp());
                }
                if lateness > 0 {
                    ctx.register_event_timer(w.max_timestamp().saturating_add(lateness));
                }
            }
            if w.max_timestamp() <= watermark {
                // A late record within the allowed lateness: fire the window again at once.
                contents.fire(&mut ctx, w);
            }
            emitted += ctx.emitted;
        }
        self.windows = windows;
        bump(&self.counters.records_out, emitted);
    }

    fn event(&mut self, ev: Event) {
        if let Event::Barrier(id) = ev {
            self.ops.snapshot(id, self.timers.encode());
        }
        if let Event::Watermark(wm) = ev {
            let wm = self.ops.advance_watermark(wm);
            let contents = self.contents.clone();
            let lateness = self.lateness;
            let session = self.assigner.is_session();
            let n = fire_timers(
                &mut self.ops,
                &mut self.timers,
                TimeDomain::EventTime,
                wm,
                &mut self.down,
                |ts, _, ctx| {
                    let Some(w) = Window::decode(ctx.namespace) else {
                        return;
                    };
                    if ts == w.max_timestamp() {
                        contents.fire(ctx, w);
                    }
                    if ts == w.max_timestamp().saturating_add(lateness) {
                        contents.clear(ctx);
                        if session {
                            let mut sessions = {
                                let ns = ctx.namespace;
                                ctx.namespace = &[];
                                let s =
                                    ctx.value::<Vec<(i64, i64)>>("sessions").unwrap_or_default();
                                ctx.namespace = ns;
                                s
                            };
                            sessions.retain(|&(s, e)| (s, e) != (w.start, w.end));
                            let ns = ctx.namespace;
                            ctx.namespace = &[];
                            if sessions.is_empty() {
                                ctx.clear_value("sessions");
                            } else {
                                ctx.set_value("sessions", &sessions);
                            }
                            ctx.namespace = ns;
                        }
                    }
                },
            );
            bump(&self.counters.records_out, n);
        }
        self.down.event(ev);
    }

    fn processing_time(&mut self, now_ms: i64) {
        self.ops.set_processing_time(now_ms);
        self.down.processing_time(now_ms);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn window_start_handles_negative_timestamps() {
        assert_eq!(window_start(15, 0, 10), Some(10));
        assert_eq!(window_start(-1, 0, 10), Some(-10));
        assert_eq!(window_start(-10, 0, 10), Some(-10));
        assert_eq!(window_start(7, 2, 5), Some(7));
        assert_eq!(window_start(i64::MIN + 5, 0, 10_000), None);
        assert_eq!(window_start(5, 0, 0), None);
    }

    /// Near either end of the i64 range a window that does not fit is an error; before, the
    /// start wrapped to a far-future window and the end was cut short.
    #[test]
    fn windows_outside_the_i64_range_are_errors_not_wrapped() {
        let mut out = vec![Window { start: 1, end: 2 }];
        let tumbling = WindowAssigner::tumbling(10_000);
        let err = tumbling.assign(-9_223_372_036_854_775_807, &mut out);
        assert_eq!(err.map_err(|e| e.ts), Err(-9_223_372_036_854_775_807));
        assert!(out.is_empty());
        assert!(tumbling.assign(i64::MAX - 3, &mut out).is_err());
        assert!(out.is_empty());
        // The last window that fits, and the first.
        let last = i64::MAX - i64::MAX.rem_euclid(10_000) - 10_000;
        tumbling.assign(last, &mut out).expect("fits");
        assert_eq!(
            out,
            [Window {
                start: last,
                end: last + 10_000
            }]
        );
        let first = window_start(i64::MIN + 10_000, 0, 10_000).expect("fits");
        tumbling.assign(first, &mut out).expect("fits");
        assert_eq!(
            out,
            [Window {
                start: first,
                end: first + 10_000
            }]
        );
        // A sliding window's earliest window can leave the range while its latest fits.
        let sliding = WindowAssigner::sliding(10_000, 1_000);
        assert!(sliding.assign(first, &mut out).is_err());
        assert!(out.is_empty());
        assert!(WindowAssigner::session(10)
            .assign(i64::MAX - 5, &mut out)
            .is_err());
        WindowAssigner::session(10)
            .assign(i64::MIN, &mut out)
            .expect("fits");
        assert_eq!(
            out,
            [Window {
                start: i64::MIN,
                end: i64::MIN + 10
            }]
        );
    }

    #[test]
    fn sliding_assigns_every_covering_window() {
        let mut out = Vec::new();
        WindowAssigner::sliding(10, 5)
            .assign(12, &mut out)
            .expect("fits");
        out.sort();
        assert_eq!(
            out,
            vec![Window { start: 5, end: 15 }, Window { start: 10, end: 20 }]
        );
    }

    #[test]
    fn window_namespace_round_trips_and_sorts_by_start() {
        let a = Window { start: -5, end: 5 };
        let b = Window { start: 3, end: 9 };
        assert_eq!(Window::decode(&a.encode()), Some(a));
        assert!(a.encode() < b.encode());
        assert_eq!(Window::decode(&[1, 2]), None);
    }
}
